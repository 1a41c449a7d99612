"""Evaluating a jaxpr with every floating-point reduction replaced by its canonical rule.

`evaluate(jaxpr, consts, *args)` walks the equations and, per primitive, either binds it again
(an operation whose bits cannot depend on the batch, the fusion or the device count: elementwise
arithmetic, data movement, integer and boolean arithmetic), applies its rule (rules.py: products,
sums, max/min, scatter-adds, collectives), or recurses into its sub-programs (this module: jit,
scan, while, cond, checkpoint, custom_jvp/custom_vjp calls, shard_map). Anything else raises
`UnsupportedPrimitiveError`, naming the primitive and the user's source line: nothing falls back.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import numpy as np
from jax import lax

from jaxdet._src.core.jaxprs import is_literal
from jaxdet._src.invariant import rules


class UnsupportedPrimitiveError(NotImplementedError):
    """An operation `jaxdet.invariant` has no canonical rule for (it never runs it as it was)."""


# The equations whose programs are being evaluated, outermost first: an operation inside a
# library's jitted function (jnp.sort is one) has a traceback that ends at that function, so its
# user's line is the innermost enclosing equation's that has one.
_ENCLOSING: list = []


def _summary(eqn) -> str:
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - the summary is a courtesy, the error is raised anyway
        return ""


def _source_line(eqn) -> str:
    for e in [eqn, *reversed(_ENCLOSING)]:
        line = _summary(e)
        if line:
            return line
    return "<unknown source line>"


def _user_context(eqn):
    """Ops emitted for `eqn` carry the user's source line (for errors, profiles and the audit)."""
    try:
        from jax._src import source_info_util

        return source_info_util.user_context(eqn.source_info.traceback, name_stack=eqn.source_info.name_stack)
    except Exception:  # pragma: no cover
        return contextlib.nullcontext()


def unsupported(eqn, why: str):
    return UnsupportedPrimitiveError(
        f"jaxdet.invariant: `{eqn.primitive.name}` {why} (at {_source_line(eqn)}). "
        "jaxdet.invariant never runs an operation it cannot make batch-invariant and deterministic; "
        "see docs/invariant.md for what is covered"
    )


def _literal_or_var(env, v):
    if is_literal(v):
        return v.val
    return env[v]


def evaluate(jaxpr, consts, *args):
    """The outputs of the open `jaxpr` on `consts` and `args`, by the canonical rules."""
    rules.enter_program()
    try:
        return _evaluate(jaxpr, consts, args)
    finally:
        rules.exit_program()


def _evaluate(jaxpr, consts, args):
    # Values fixed when the program is traced (literals, and what is computed from them alone)
    # would be constants to XLA, whose simplifier reassociates products with constants on some
    # compilation paths and not others (a shard_map's partitioned module, a one-element array).
    # They enter the arithmetic through `rules.runtime_value`, which XLA cannot see through.
    env, fixed = {}, set()
    wanted, partials = _partials_wanted(jaxpr), {}
    swapped = _products_read_transposed(jaxpr)
    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        if eqn in swapped:
            eqn = swapped[eqn]
            if eqn is None:  # a transpose whose value the swapped product already made
                continue
        known = [is_literal(v) or v in fixed for v in eqn.invars]
        invals = [_literal_or_var(env, v) for v in eqn.invars]
        higher = eqn.primitive.name in _HIGHER_ORDER
        if all(known) and not higher and not eqn.effects:
            with _user_context(eqn):
                outs = apply(eqn, invals)
            outs = list(outs) if eqn.primitive.multiple_results else [outs]
            if any(rules.is_float(getattr(o, "dtype", None)) for o in outs):
                outs = [rules.runtime_value(o) for o in outs]
            else:
                fixed.update(eqn.outvars)  # integer and boolean constants fold exactly
        else:
            invals = [
                rules.runtime_value(jax.numpy.asarray(x, v.aval.dtype)) if is_literal(v) else x
                for v, x in zip(eqn.invars, invals)
            ]
            with _user_context(eqn):
                outs = _apply_with_partials(eqn, invals, wanted, partials)
        for v, x in zip(eqn.outvars, outs):
            if type(v).__name__ != "DropVar":
                env[v] = x
    return [_literal_or_var(env, v) for v in jaxpr.outvars]


def _products_read_transposed(jaxpr):
    """`dot_general` equations whose only use is a transpose that swaps the two operands' free
    dimensions (JAX's derivative of ``x @ w`` with respect to ``w`` is ``transpose(g^T x)``):
    each maps to the product with its operands swapped, which writes the transposed result
    directly, and its transpose maps to None. The bits are the same: each element is the same
    products, folded over the same contracted index by the rule; only the materialised transpose
    (and a consumer reading it transposed, an optimizer's update) goes."""
    uses = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not is_literal(v):
                uses[v] = uses.get(v, 0) + 1
    for v in jaxpr.outvars:
        if not is_literal(v):
            uses[v] = uses.get(v, 0) + 2  # an output is never replaced
    producers = {eqn.outvars[0]: eqn for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"}
    swapped = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "transpose" or is_literal(eqn.invars[0]):
            continue
        product = producers.get(eqn.invars[0])
        if product is None or uses.get(eqn.invars[0]) != 1:
            continue
        (lc, rc), (lb, rb) = product.params["dimension_numbers"]
        lhs, rhs = (v.aval.ndim for v in product.invars)
        nb, nl = len(lb), lhs - len(lc) - len(lb)
        nr = rhs - len(rc) - len(rb)
        perm = tuple(range(nb)) + tuple(range(nb + nl, nb + nl + nr)) + tuple(range(nb, nb + nl))
        if tuple(eqn.params["permutation"]) != perm:
            continue
        swapped[product] = product.replace(
            invars=product.invars[::-1],
            outvars=eqn.outvars,
            params={**product.params, "dimension_numbers": ((rc, lc), (rb, lb))},
        )
        swapped[eqn] = None
    return swapped


def _partials_wanted(jaxpr):
    """The variables whose float32 value before rounding a collective sum will continue
    (rules.unrounded): the operands of psum-like equations, and back through adds, conversions
    and data movement to the products and sums that make them."""
    wanted = set()
    for eqn in reversed(jaxpr.eqns):
        name = eqn.primitive.name
        carries = name in rules.CARRIES_PARTIALS or name in rules.MOVES_PARTIALS
        if name in rules.COLLECTIVE_SUMS or (carries and any(v in wanted for v in eqn.outvars)):
            wanted.update(v for v in eqn.invars if not is_literal(v))
    return wanted


def _apply_with_partials(eqn, invals, wanted, partials):
    """`apply`, with a collective sum continuing its operands' float32 partial sums (rounded once
    after it), and a wanted value's float32 partial kept beside its rounded value."""
    name = eqn.primitive.name
    if name in rules.COLLECTIVE_SUMS and any(not is_literal(v) and v in partials for v in eqn.invars):
        wide = [x if is_literal(v) else partials.get(v, x) for v, x in zip(eqn.invars, invals)]
        outs = apply(eqn, wide)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
        return [o.astype(v.aval.dtype) for o, v in zip(outs, eqn.outvars)]
    out = eqn.outvars[0]
    if len(eqn.outvars) == 1 and out in wanted:
        part = rules.unrounded(eqn, invals, [None if is_literal(v) else partials.get(v) for v in eqn.invars])
        if part is not None:
            partials[out] = part
            return [part.astype(out.aval.dtype)]
    outs = apply(eqn, invals)
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    if len(eqn.outvars) == 1 and out in wanted and name in rules.SUMS and out.aval.dtype == np.float32:
        partials[out] = outs[0]  # a float32 sum by the rule is its own partial
    return outs


def evaluate_closed(closed, *args):
    return evaluate(closed.jaxpr, closed.consts, *args)


def apply(eqn, invals):
    name = eqn.primitive.name
    higher = _HIGHER_ORDER.get(name)
    if higher is not None:
        _ENCLOSING.append(eqn)
        try:
            return higher(eqn, *invals)
        finally:
            _ENCLOSING.pop()
    return rules.apply(eqn, invals, unsupported)


# ---- Programs inside programs ----


def _jit(eqn, *args):
    # The inner program is evaluated in place: the outer jit compiles it anyway.
    return evaluate_closed(eqn.params["jaxpr"], *args)


def _closed_call(eqn, *args):
    return evaluate_closed(eqn.params["call_jaxpr"], *args)


def _scan(eqn, *args):
    p = eqn.params
    body, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
    consts, carry, xs = args[:n_consts], args[n_consts : n_consts + n_carry], args[n_consts + n_carry :]

    def step(c, x):
        outs = evaluate_closed(body, *consts, *c, *x)
        return list(outs[:n_carry]), list(outs[n_carry:])

    carry_out, ys = lax.scan(
        step, list(carry), list(xs), length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1)
    )
    return [*carry_out, *ys]


def _while(eqn, *args):
    p = eqn.params
    cn, bn = p["cond_nconsts"], p["body_nconsts"]
    cond_consts, body_consts, init = args[:cn], args[cn : cn + bn], args[cn + bn :]

    def cond_fun(c):
        return evaluate_closed(p["cond_jaxpr"], *cond_consts, *c)[0]

    def body_fun(c):
        return list(evaluate_closed(p["body_jaxpr"], *body_consts, *c))

    return lax.while_loop(cond_fun, body_fun, list(init))


def _cond(eqn, index, *ops):
    branches = [functools.partial(evaluate_closed, b) for b in eqn.params["branches"]]
    return lax.switch(index, branches, *ops)


def _remat(eqn, *args):
    p = eqn.params
    inner = p["jaxpr"]

    def body(*a):
        return evaluate(inner, (), *a)

    return jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))(*args)


def _custom_call(eqn, *args):
    # custom_jvp / custom_vjp: the primal program. jaxdet.invariant differentiates before it
    # evaluates (invariant.py), so the custom rules have already been applied where they matter.
    return evaluate_closed(eqn.params["call_jaxpr"], *args)


def _shard_map(eqn, *args):
    p = eqn.params
    inner = p["jaxpr"]
    manual = p.get("manual_axes", p.get("newly_manual_axes"))
    kwargs = {}
    if manual is not None:
        kwargs["axis_names"] = set(manual)
    check = p.get("check_vma", p.get("check_rep", True))

    def body(*a):
        return tuple(evaluate(inner, (), *a))  # out_specs is a tuple: the same pytree

    return jax.shard_map(
        body, mesh=p["mesh"], in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]), check_vma=check, **kwargs
    )(*args)


_HIGHER_ORDER = {
    "jit": _jit,
    "pjit": _jit,
    "closed_call": _closed_call,
    "core_call": _closed_call,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
    "remat2": _remat,
    "checkpoint": _remat,
    "custom_jvp_call": _custom_call,
    "custom_vjp_call": _custom_call,
    "custom_vjp_call_jaxpr": _custom_call,
    "shard_map": _shard_map,
}
