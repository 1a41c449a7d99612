"""Derivatives of the public functions.

* `linear_call`: a linear map with its own transpose, as one primitive (``jaxdet_linear``). A public
  function's tangent is such a map (built from jaxdet kernels), and its transpose is the function's
  backward kernels, so ``jax.jvp``, ``jax.linearize``, ``jax.grad`` and their compositions share one
  definition and reverse mode runs exactly the backward kernels (docs/derivatives.md).
* `jvp_of_formula`: a kernel primitive whose derivative is that of a formula written with jaxdet's
  differentiable operations (elementwise jnp and ``jaxdet.sum``): the tangents of backward kernels,
  which second derivatives need.
* Functions that support reverse mode only are ``jax.custom_vjp`` functions; forward mode through
  them raises errors that name the public function and what is supported, instead of JAX's generic
  messages about internal primitives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.extend import core as jex_core
from jax.interpreters import ad, batching, mlir

from jaxdet._src.core import batching as jaxdet_batching
from jaxdet._src.core import ffi

_JVP_OF_CUSTOM_VJP = "forward-mode autodiff (jvp) to a custom_vjp function"


def support_message(public: str, *, higher_order: bool = False) -> str:
    """What `public` supports: reverse mode once (or, with `higher_order`, to any order), and what to
    use instead of forward mode."""
    instead = "use reverse mode instead (jax.vjp, or jax.jacrev for a Jacobian)"
    if higher_order:
        return (
            f"{public} supports reverse-mode differentiation to any order (jax.grad, jax.vjp, "
            f"jax.value_and_grad); forward mode (jax.jvp, jax.jacfwd, jax.linearize) is not supported yet: {instead}"
        )
    return (
        f"{public} supports reverse-mode differentiation once (jax.grad, jax.vjp, jax.value_and_grad); "
        "forward mode (jax.jvp, jax.jacfwd, jax.linearize, jax.hessian) and differentiating its gradient "
        f"again are not supported yet: {instead}"
    )


def refuse_jvp(namespace: dict, public_of, message=None) -> None:
    """A JVP rule for every primitive in `namespace` (a module's globals) that has none, raising
    NotImplementedError naming the public function ``public_of(params)``: `message(public)` says
    what is not supported (default: `support_message`)."""
    message = message or support_message
    for prim in [v for v in namespace.values() if isinstance(v, jex_core.Primitive)]:
        if prim in ad.primitive_jvps:
            continue

        def rule(primals, tangents, **params):
            raise NotImplementedError(message(public_of(params)))

        ad.primitive_jvps[prim] = rule


def reverse_only(public: str, fn, *args, higher_order: bool = False):
    """``fn(*args)``; JAX's TypeError for forward mode through a custom_vjp function becomes a
    `ForwardModeNotSupported` naming `public`. (Under ``jax.jvp`` of a ``jax.jit``-ed function the
    custom_vjp is met when the jitted program is differentiated, outside this frame: JAX's own
    message then.)"""
    try:
        return fn(*args)
    except TypeError as e:
        if _JVP_OF_CUSTOM_VJP not in str(e):
            raise
        raise ForwardModeNotSupported(
            f"{support_message(public, higher_order=higher_order)} (it is a jax.custom_vjp function)"
        ) from e


class ForwardModeNotSupported(NotImplementedError, TypeError):
    """Forward-mode differentiation of a public function that supports reverse mode only (a
    NotImplementedError; a TypeError too, which is what JAX raises for a custom_vjp function)."""


# ---- linear_call: fn(*res, *lin) -> tuple, linear in `lin`; transpose(*res, *cts) -> a tuple like
# `lin`. The residuals `res` may be differentiated too (fn's derivative in them, `lin` held). ----

linear_p = jex_core.Primitive("jaxdet_linear")
linear_p.multiple_results = True


def linear_call(fn, transpose, res, lin, out_avals=None):
    """``fn(*res, *lin)`` (a tuple of arrays), linear in `lin`, whose transpose in `lin` is
    ``transpose(*res, *cotangents)``. Under ``jax.grad`` / ``jax.linear_transpose`` the transpose runs
    (its operations are bound directly, so the backward kernels appear in the program); under
    ``jax.jvp`` a tangent of `lin` goes through `fn` again, and a tangent of `res` through fn's own
    derivative (fn must be differentiable in res).

    `out_avals` (a tuple of ``jax.core.ShapedArray``), when given, is fn's result type: then reverse
    mode never traces `fn` (whose operations may need what the transpose does not, such as static
    shapes under ``jax.export``)."""
    out_avals = None if out_avals is None else tuple(out_avals)
    return linear_p.bind(*res, *lin, fn=fn, transpose=transpose, n_res=len(res), out_avals=out_avals)


def _linear_abstract_eval(*avals, fn, transpose, n_res, out_avals):
    if out_avals is not None:
        return out_avals
    return jax.make_jaxpr(lambda *a: tuple(fn(*a)))(*avals).out_avals


def _linear_impl(*args, fn, transpose, n_res, out_avals):
    return tuple(fn(*args))


def _linear_jvp(primals, tangents, *, fn, transpose, n_res, out_avals):
    res, lin = primals[:n_res], primals[n_res:]
    t_res, t_lin = tangents[:n_res], tangents[n_res:]
    kw = dict(fn=fn, transpose=transpose, n_res=n_res, out_avals=out_avals)
    out = linear_p.bind(*primals, **kw)
    parts = []
    if any(type(t) is not ad.Zero for t in t_lin):
        parts.append(linear_p.bind(*res, *map(ad.instantiate_zeros, t_lin), **kw))
    if any(type(t) is not ad.Zero for t in t_res):
        _, d = jax.jvp(lambda *r: tuple(fn(*r, *lin)), tuple(res), tuple(map(ad.instantiate_zeros, t_res)))
        parts.append(d)
    if not parts:
        return out, [zero_tangent(o) for o in out]
    tangent = parts[0] if len(parts) == 1 else [a + b for a, b in zip(*parts)]
    return out, list(tangent)


def _linear_transpose(cts, *args, fn, transpose, n_res, out_avals):
    res, lin = args[:n_res], args[n_res:]
    if any(ad.is_undefined_primal(r) for r in res):
        # Residuals come from primal values: a tangent map is never transposed in them.
        raise NotImplementedError("a jaxdet tangent map was transposed in an argument it is not linear in")
    if all(type(ct) is ad.Zero for ct in cts):
        return [None] * n_res + [ad.Zero(x.aval) if ad.is_undefined_primal(x) else None for x in lin]
    cts = [ad.instantiate_zeros(ct) for ct in cts]
    outs = transpose(*res, *cts)
    return [None] * n_res + [o if ad.is_undefined_primal(x) else None for o, x in zip(outs, lin)]


def _linear_batch(args, dims, *, fn, transpose, n_res, out_avals):
    size = jaxdet_batching.batch_size(args, dims)
    res, lin = args[:n_res], args[n_res:]
    res_axes = tuple(None if jaxdet_batching.not_mapped(d) else d for d in dims[:n_res])
    # Every linear operand batched at 0, so that the transpose's results are batched like them.
    lin = [jaxdet_batching.moved_to_front(x, d, size) for x, d in zip(lin, dims[n_res:])]
    batched_fn = jax.vmap(lambda *a: tuple(fn(*a)), in_axes=res_axes + (0,) * len(lin))

    def batched_transpose(*a):
        return jax.vmap(lambda *b: tuple(transpose(*b)), in_axes=res_axes + (0,) * (len(a) - n_res))(*a)

    if out_avals is not None:  # every result batched at 0
        out_avals = tuple(a.update(shape=(size,) + tuple(a.shape)) for a in out_avals)
    out = linear_p.bind(*res, *lin, fn=batched_fn, transpose=batched_transpose, n_res=n_res, out_avals=out_avals)
    return out, [0] * len(out)


linear_p.def_impl(_linear_impl)
linear_p.def_abstract_eval(_linear_abstract_eval)
ad.primitive_jvps[linear_p] = _linear_jvp
ad.primitive_transposes[linear_p] = _linear_transpose
batching.primitive_batchers[linear_p] = _linear_batch
mlir.register_lowering(linear_p, mlir.lower_fun(_linear_impl, multiple_results=True))
ffi.lowers_with_devices(linear_p)  # fn may bind partitioned composites (jaxdet.sum, the backward kernels)


@jax.custom_jvp
def _rounded(x, zero):
    # x's bits xor a run-time zero: the same value, which no compiler can fuse into a following add.
    uint = {2: jnp.uint16, 4: jnp.uint32}[np.dtype(x.dtype).itemsize]
    z = jax.lax.bitcast_convert_type(zero, jnp.uint32).astype(uint)
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, uint) ^ z, x.dtype)


@_rounded.defjvp
def _rounded_jvp(primals, tangents):
    return _rounded(*primals), tangents[0]


def rounded_sum(terms):
    """The sum of `terms` (floats of one shape and dtype), each rounded to its dtype before the adds.

    On the CPU, XLA lets LLVM contract a multiply and an add of one fused loop into one FMA (no
    flag turns that off, and optimization barriers are removed before fusion), so ``a * b + c``
    could round once under jit and twice eagerly. Each term passes through an identity XLA cannot
    see through (its bits xor a zero made by a jaxdet kernel at run time), so the sum has the same
    bits eager, jitted and in any batch. For a function's values only (a tangent map's `fn`), not
    for values that are themselves linear in a tangent being transposed.
    """
    terms = list(terms)
    if len(terms) > 1:
        from jaxdet._src.reduce.reduce import reduce_sum  # a kernel: a zero XLA cannot fold

        zero = reduce_sum(jnp.zeros((1,), jnp.float32), (0,), np.dtype(np.float32))
        terms = [_rounded(t, zero) for t in terms]
    total = terms[0]
    for t in terms[1:]:
        total = total + t
    return total


def zero_tangent(value):
    """A symbolic zero tangent for `value` (a primitive's JVP rule result)."""
    return ad.Zero(jax.typeof(value).to_tangent_aval())


def is_zero(t) -> bool:
    """Whether a tangent given to a ``custom_jvp`` rule (``symbolic_zeros=True``) is a symbolic zero."""
    return isinstance(t, SymbolicZero)


def jvp_of_formula(prim, formula):
    """The JVP rule of `prim`: its own result, and the tangent of ``formula(*operands, **params)``
    (the same math written with differentiable jaxdet operations, so that every order works and
    every reduction in the tangent is a jaxdet one). Each tangent has its result's dtype."""

    def rule(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        _, tangent = jax.jvp(
            lambda *a: formula(*a, **params), tuple(primals), tuple(map(ad.instantiate_zeros, tangents))
        )
        if prim.multiple_results:
            return out, [t.astype(o.dtype) for t, o in zip(tangent, out)]
        return out, tangent.astype(out.dtype)

    ad.primitive_jvps[prim] = rule
