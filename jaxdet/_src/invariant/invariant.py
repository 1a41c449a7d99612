"""`jaxdet.invariant`: a function transformation whose result computes every floating-point
reduction of the function by one canonical rule (docs/invariant.md).

The function is traced to a jaxpr and evaluated by `interpreter.evaluate`. Derivatives are taken
before the rules apply: under `jax.grad` (or `vjp`), the transformed function is a `custom_vjp`
whose forward evaluates JAX's own forward-with-residuals program of the function and whose backward
evaluates JAX's own backward program, both by the same rules. So the reductions that only the
derivative has (the sum of a broadcast bias's cotangent, the scatter-add of a gather's, the psum
of a replicated parameter's in `shard_map`) follow the rule too, and
``jax.grad(invariant(f))`` computes exactly the operations of ``invariant(jax.grad(f))``.
"""

from __future__ import annotations

import functools

import jax
import jax.extend as jex
import numpy as np

from jaxdet._src.core import graph_state, xla_flags
from jaxdet._src.invariant import attention, interpreter
from jaxdet._src.matmul.matmul import WGRAD_CHUNK_TOKENS


def _program(jaxpr, n_consts):
    """The traced function of (consts, args), its constants made inputs (so that derivatives
    reach the values the function closes over)."""

    def run(*inputs):
        closed = jex.core.ClosedJaxpr(jaxpr, list(inputs[:n_consts]))
        return jex.core.jaxpr_as_fun(closed)(*inputs[n_consts:])

    return run


def _is_float0(x) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


def _call(jaxpr, n_consts, inputs):
    program = _program(jaxpr, n_consts)
    pullback_tree = {}

    @jax.custom_vjp
    def call(*xs):
        return interpreter.evaluate(jaxpr, xs[:n_consts], *xs[n_consts:])

    def fwd(*xs):
        def forward_with_residuals(*ys):
            out, pullback = jax.vjp(program, *ys)
            res, pullback_tree["tree"] = jax.tree.flatten(pullback)
            return out, res

        closed = jax.make_jaxpr(forward_with_residuals)(*xs)
        flat = interpreter.evaluate_closed(closed, *xs)
        n_out = len(jaxpr.outvars)
        return list(flat[:n_out]), list(flat[n_out:])

    def bwd(res, cts):
        def backward(res, cts):
            pullback = jax.tree.unflatten(pullback_tree["tree"], res)
            return pullback(list(cts))

        closed = jax.make_jaxpr(backward)(list(res), list(cts))
        grads = interpreter.evaluate_closed(closed, *res, *cts)
        return tuple(None if _is_float0(g) else g for g in grads)

    call.defvjp(fwd, bwd)
    return call(*inputs)


def _check_cpu_flags():
    missing = xla_flags.missing()
    if missing and jax.default_backend() == "cpu":
        raise RuntimeError(
            "jaxdet.invariant on the CPU needs XLA flags that make elementwise bits independent of "
            f"fusion and array length, and this process runs without {' '.join(missing)}: jax had "
            "started its backends before jaxdet was imported (jaxdet sets them at import otherwise), or "
            "XLA_FLAGS sets them otherwise. Import jaxdet before running any JAX computation, or start "
            f"the process with XLA_FLAGS='{' '.join(missing)}' (docs/invariant.md, 'Elementwise bits')"
        )


def _evaluate_invariantly(fn, args, kwargs):
    _check_cpu_flags()
    flat_args, in_tree = jax.tree.flatten((args, kwargs))
    for leaf in flat_args:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) and not isinstance(
            leaf, (bool, int, float, complex, np.generic)
        ):
            raise TypeError(
                f"jaxdet.invariant({getattr(fn, '__name__', 'fn')}): arguments must be arrays or pytrees of "
                f"arrays (they are traced), got a leaf of type {type(leaf).__name__}; pass static "
                "configuration with functools.partial"
            )

    def flat_fn(*flat):
        a, k = jax.tree.unflatten(in_tree, flat)
        return fn(*a, **k)

    with attention.on_jaxdet_kernels():
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*flat_args)
    out_tree = jax.tree.structure(out_shape)
    consts = list(closed.consts)
    out = _call(closed.jaxpr, len(consts), [*consts, *flat_args])
    return jax.tree.unflatten(out_tree, out)


def invariant(fn):
    """Transform ``fn`` so that its floating-point reductions follow jaxdet's canonical rule.

    ``jaxdet.invariant(fn)`` is a function with ``fn``'s signature (arguments are traced, as
    ``jax.jit`` traces them: pass static configuration through ``functools.partial``). Every
    product (``dot_general``, any dimension numbers), sum (``reduce_sum``), max/min,
    scatter-add (the gradient of ``jnp.take``) and collective sum (``psum`` in ``shard_map``) in
    ``fn`` -- in its derivatives too -- is computed by the canonical rule: fold in index order
    within chunks of ``jaxdet.invariant.CHUNK_TOKENS`` elements, then the canonical tree over
    the chunks (and over devices). So a row's bits never depend on other rows, appending zeros
    changes no bit, and pieces of whole chunks (micro-batches, devices) reproduce the whole.
    Elementwise operations and data movement run as they are; anything without a rule
    (convolutions, sorts, random bits not from jaxdet, ...) raises
    ``jaxdet.invariant.UnsupportedPrimitiveError`` naming the operation and the source line.

    Composes with ``jax.jit``, ``jax.grad`` (either order), ``jax.vmap``, ``jax.shard_map``
    (inside or outside) and sharded ``jit``. Forward-mode derivatives (``jax.jvp``) of the
    transformed function are not available (it is a ``jax.custom_vjp``). docs/invariant.md.
    """
    if not callable(fn):
        raise TypeError(f"jaxdet.invariant expects a callable, got {type(fn).__name__}")

    @functools.wraps(fn)
    def transformed(*args, **kwargs):
        nnx = graph_state.nnx_module((args, kwargs))
        if nnx is None:
            return _evaluate_invariantly(fn, args, kwargs)
        # NNX objects as arguments (nnx.jit's convention): their state in, their new state out, so
        # the in-place updates of the step are evaluated by the rules too; then written back.
        pure, pure_args, write_back = graph_state.as_pure(nnx, fn, args, kwargs)
        out, new_state = _evaluate_invariantly(pure, pure_args, {})
        write_back(new_state)
        return out

    return transformed


invariant.UnsupportedPrimitiveError = interpreter.UnsupportedPrimitiveError

invariant.CHUNK_TOKENS = WGRAD_CHUNK_TOKENS
