"""A canonical sum over any axes (``jaxdet.sum``) and a bias add whose gradient follows it (``jaxdet.bias_add``).

The rule (docs/reduce.md, proven by tests/test_reduce.py) is dB's (``jaxdet.matmul_weight_grad``):

* The reduced elements of an output are indexed by k, the row-major flattening of the reduced axes
  (in increasing axis order), and cut into chunks of ``CHUNK_TOKENS`` (8192) by absolute index:
  chunk c = k // CHUNK_TOKENS.
* Within a chunk, the elements are folded in ascending k in float32 from +0.0: ``acc = acc + x[k]``
  (one IEEE add each, round to nearest even, never fused, never reassociated). bfloat16 and float16
  inputs are widened exactly.
* The chunk partials are combined by the canonical tree (``jaxdet.parallel.tree_sum``'s: balanced,
  lower index first, padded to a power of two with absent leaves), in float32, and the root is cast
  once (RNE) to the output dtype.

So an output's bits depend on its own reduced elements only (never on the other outputs, the array's
other sizes, the device, the threads or the launch configuration); appended zeros change no bit;
pieces of 2^j whole chunks reduced separately and combined by ``tree_sum`` give the whole's bits,
which is how a reduction split over devices combines (``tree_psum``) under ``jax.shard_map`` and
sharded ``jax.jit``.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import autodiff, checks, ffi, tree, varying
from jaxdet._src.core.checks import FLOAT_DTYPES
from jaxdet._src.matmul.matmul import WGRAD_CHUNK_TOKENS

__all__ = ["sum", "bias_add", "reduce_sum", "CHUNK_TOKENS", "SUPPORTED_DTYPES"]

# Elements per chunk: the leaves of the canonical tree (the same chunks as dB's tokens).
CHUNK_TOKENS = WGRAD_CHUNK_TOKENS
SUPPORTED_DTYPES = FLOAT_DTYPES

_F32 = np.dtype(jnp.float32)


def _chunks(k):
    return -(-k // CHUNK_TOKENS)


# ---- Primitive 1: jaxdet_reduce. x [A, K, B] -> [A, B] of out_dtype (float32 or x's dtype); on
# CUDA one more result, the float32 chunk partials [chunks, A, B] when K spans several chunks. ----


def _reduce_abstract_eval(x, *, out_dtype):
    A, _, B = x.shape
    return ffi.shaped((A, B), out_dtype)


def _reduce_workspace(avals, *, out_dtype):
    A, K, B = avals[0].shape
    chunks = _chunks(K)
    return chunks * A * B * 4 if chunks > 1 else 0  # cuda/reduce/reduce_ffi.h workspace_bytes


def _reduce_batch(args, dims, *, out_dtype):
    (x,), (d,) = args, dims
    x = jnp.moveaxis(x, d, 0)  # [S, A, K, B]: the vmapped axis joins A
    S, A, K, B = x.shape
    out = reduce_p.bind(x.reshape(S * A, K, B), out_dtype=out_dtype)
    return out.reshape(S, A, B), 0


reduce_p = ffi.define_primitive(
    "jaxdet_reduce",
    _reduce_abstract_eval,
    attributes=lambda out_dtype: dict(chunk=np.int64(CHUNK_TOKENS)),
    batching_rule=_reduce_batch,
    cuda_workspace=_reduce_workspace,
)


def _reduce3(x3, out_dtype):
    """x3 [A, K, B] -> [A, B]: the rule; empty operands give +0 with no kernel."""
    A, K, B = x3.shape
    if A * B == 0 or K == 0:
        return tree.match_varying(jnp.zeros((A, B), out_dtype), varying.varying_axes(x3))
    return reduce_p.bind(x3, out_dtype=np.dtype(out_dtype))


# ---- Primitive 2 (composite): jaxdet_sum. x [*pre, K, *post] (the reduced axes merged into one, K)
# -> [*pre, *post]. It exists to carry a partitioning rule on the array as the caller shaped it: a
# split of any kept axis runs per device with no collective; with K split over devices, each device
# reduces its own chunks and the devices' float32 partials are combined by the canonical tree
# (`tree_psum_untyped`, the top levels of the same tree), which gives the unsplit bits when every
# device holds 2^j whole chunks (`tree.whole_chunk_split`); other splits of K are all-gathered. ----


def _sum_abstract_eval(x, *, k_axis, out_dtype):
    return ffi.shaped(x.shape[:k_axis] + x.shape[k_axis + 1 :], out_dtype)


def _sum_factors(params, shapes):
    (shape,) = shapes
    ka = params["k_axis"]
    pre = tuple(f"a{i}" for i in range(ka))
    post = tuple(f"b{i}" for i in range(len(shape) - ka - 1))
    return [pre + ("k",) + post], [pre + post]


def _sum_local(params, axes, shapes):
    ka, out_dtype = params["k_axis"], params["out_dtype"]
    k_axes = axes.get("k", ())

    def run(x):
        pre, K, post = x.shape[:ka], x.shape[ka], x.shape[ka + 1 :]
        x3 = x.reshape(math.prod(pre), K, math.prod(post))
        out = tree.reduce_over_devices(lambda dt: _reduce3(x3, dt), k_axes, out_dtype)
        return out.reshape(pre + post)

    return run


def _sum_batch(args, dims, *, k_axis, out_dtype):
    (x,), (d,) = args, dims
    # The vmapped axis is one more kept axis in front: each output's reduced elements are unchanged.
    return sum_p.bind(jnp.moveaxis(x, d, 0), k_axis=k_axis + 1, out_dtype=out_dtype), 0


# A split of the reduced dimension only along whole subtrees of its chunk tree.
_K_SPLIT = tree.whole_chunk_split("k", CHUNK_TOKENS)
sum_p = ffi.define_composite(
    "jaxdet_sum",
    _sum_abstract_eval,
    ffi.Partitioning(
        _sum_factors, reduced=frozenset({"k"}), local=_sum_local, can_split=tree.whole_chunk_split("k", CHUNK_TOKENS)
    ),
    batching_rule=_sum_batch,
)


# ---- The differentiable core: the sum and the broadcast are linear maps and each other's
# transposes (`autodiff.linear_call`), so the cotangent of a sum is a broadcast (no reduction), the
# cotangent of that broadcast (a second derivative) is the canonical sum again, and the tangent of
# a sum (forward mode) is the canonical sum of the tangent. ----


def _moved_together(x, axes):
    """(x as [*pre, K, *post], len(pre)): the reduced axes (sorted) made adjacent, then merged.

    Adjacent axes are merged by a reshape (no copy). Otherwise the reduced axes move to sit
    together ending at the last of them, so the kept axes after it (the minor ones) stay in place
    and the transpose moves the fewest elements; the order of the kept axes, and the row-major
    order of the reduced ones, are unchanged.
    """
    last = axes[-1]
    if axes != tuple(range(axes[0], last + 1)):
        kept_before = [i for i in range(last) if i not in axes]
        x = jnp.transpose(x, (*kept_before, *axes, *range(last + 1, x.ndim)))
        first = len(kept_before)
    else:
        first = axes[0]
    shape = x.shape
    K = math.prod(shape[first : first + len(axes)])
    return x.reshape(shape[:first] + (K,) + shape[first + len(axes) :]), first


def _sum_of(x, axes, out_dtype):
    x, k_axis = _moved_together(x, axes)
    return sum_p.bind(x, k_axis=k_axis, out_dtype=np.dtype(out_dtype))


def _proxy(x):
    """A zero-size residual that carries a primal's shape (proxy.shape[1:]), dtype and varying axes."""
    return x[None][:0]


def _sum(x, axes, out_dtype):
    """x summed over `axes` (sorted, non-empty) by the rule, to out_dtype; x non-empty, K > 0."""
    shape, dtype, vma = x.shape, x.dtype, varying.varying_axes(x)

    def transpose(g):
        # The cotangent in x's dtype (a float32 cotangent of a bfloat16/float16 sum rounded once),
        # broadcast over the reduced axes: no reduction.
        return (tree.match_varying(_broadcast(g.astype(dtype), axes, shape), vma),)

    return autodiff.linear_call(lambda x: (_sum_of(x, axes, out_dtype),), transpose, (), (x,))[0]


def _broadcast(g, axes, shape):
    """g (shaped as `shape` without `axes`) broadcast over `axes` to `shape`."""
    kept = tuple(i for i in range(len(shape)) if i not in axes)
    dtype, vma = g.dtype, varying.varying_axes(g)

    def transpose(ct):
        # The transpose of a broadcast is the sum over the broadcast axes: the canonical one.
        dg = _sum(ct.astype(dtype), axes, dtype) if math.prod(shape) else jnp.zeros(g.shape, dtype)
        return (tree.match_varying(dg, vma),)

    return autodiff.linear_call(lambda g: (jax.lax.broadcast_in_dim(g, shape, kept),), transpose, (), (g,))[0]


# ---- Checks and the public functions. ----

_INTEGER_HELP = "integer and bool sums are exact in any order: use jnp.sum for them (jaxdet adds nothing there)"


def _float_input(x, name, public):
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        raise TypeError(f"{public}: {name} must be a JAX or NumPy array, got {type(x).__name__}")
    dtype = np.dtype(x.dtype)
    if jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_):
        raise TypeError(f"{public}: {name} is {dtype.name}; {_INTEGER_HELP}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{public}: {name} must be float32, bfloat16 or float16, got {dtype.name}")
    return dtype


def _axis_int(a, ndim):
    if isinstance(a, (bool, np.bool_)) or not isinstance(a, (numbers.Integral, np.integer)):
        raise TypeError(f"axis must be None, an int or a tuple of ints, got {type(a).__name__}")
    a = int(a)
    if not -ndim <= a < ndim:
        raise ValueError(f"axis {a} is out of range for an array of rank {ndim}")
    return a % ndim


def _normalize_axes(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    axes = [_axis_int(a, ndim) for a in axis] if isinstance(axis, (tuple, list)) else [_axis_int(axis, ndim)]
    if len(set(axes)) != len(axes):
        raise ValueError(f"axis has a duplicate entry: {axis!r}")
    return tuple(sorted(axes))


def reduce_sum(x, axes, out_dtype):
    """``lax.reduce_sum_p``'s semantics by the canonical rule: for ``jaxdet.invariant``.

    Args:
      x: a float32, bfloat16 or float16 array.
      axes: a tuple of distinct non-negative ints below ``x.ndim`` (any order): the reduced axes.
      out_dtype: x's dtype, or float32.

    Returns x summed over `axes` (the axes removed), by the rule of docs/reduce.md, rounded once to
    out_dtype. No axes: x cast to out_dtype (nothing is added). Differentiable (forward and reverse), and
    works under jit, vmap, remat, scan, ``jax.shard_map`` and sharded ``jax.jit`` (docs/reduce.md).
    """
    x_dtype = _float_input(x, "x", "jaxdet reduce_sum")
    x = jnp.asarray(x)
    axes = tuple(axes)
    for a in axes:
        if isinstance(a, (bool, np.bool_)) or not isinstance(a, (numbers.Integral, np.integer)):
            raise TypeError(f"axes must be a tuple of ints, got {axes!r}")
        if not 0 <= a < x.ndim:
            raise ValueError(f"axes must be non-negative and below the rank {x.ndim}, got {axes!r}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"axes has a duplicate entry: {axes!r}")
    axes = tuple(sorted(int(a) for a in axes))
    out_dtype = checks.accumulated_result_dtype(x_dtype, out_dtype, "out_dtype")
    if not axes:
        return x.astype(out_dtype)
    out_shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    if x.size == 0:  # no outputs, or nothing to add: +0
        return tree.match_varying(jnp.zeros(out_shape, out_dtype), varying.varying_axes(x))
    return _sum(x, axes, out_dtype)


def sum(x, axis=None, dtype=None, keepdims=False):  # jnp.sum's name, on purpose
    """Canonical ``jnp.sum``: the same bits for every batch size, layout, device and device count.

    Args:
      x: a float32, bfloat16 or float16 array (integer and bool inputs raise a TypeError: their sums
        are exact, use ``jnp.sum``).
      axis: None (every axis), an int or a tuple of ints; negative values count from the end.
      dtype: None (x's dtype), x's dtype, or float32 (a float32 result for bfloat16/float16 x).
      keepdims: keep the reduced axes with size 1.

    The reduced elements of each output, in row-major order of the reduced axes, are cut into
    chunks of ``jaxdet.sum.CHUNK_TOKENS`` (8192); each chunk is added in ascending order in float32
    from +0; the chunk partials are combined by ``jaxdet.parallel.tree_sum``'s tree; the result is
    rounded once to `dtype` (docs/reduce.md). An output's bits depend on its own elements only.
    Differentiable to any order, forward and reverse (a linear map: the tangent is this sum of the
    tangent; the cotangent is broadcast, and the cotangent of that broadcast is this sum again).
    """
    x_dtype = _float_input(x, "x", "jaxdet.sum")
    axes = _normalize_axes(axis, len(x.shape))
    out = reduce_sum(x, axes, checks.accumulated_result_dtype(x_dtype, dtype, "dtype"))
    if keepdims:
        out = out.reshape(tuple(1 if i in axes else d for i, d in enumerate(x.shape)))
    return out


@jax.custom_vjp
def _bias_add(x, b):
    return x + b


def _bias_add_fwd(x, b):
    return _bias_add(x, b), (_proxy(x), b)


def _bias_add_bwd(res, g):
    x_proxy, b = res
    dx = tree.match_varying(g, varying.varying_axes(x_proxy))
    # Every leading dimension is a token, flattened row-major.
    tokens = g.reshape(math.prod(g.shape[:-1]), g.shape[-1])
    vma = varying.varying_axes(b)

    def db_in(dtype):
        if tokens.size == 0:
            return tree.match_varying(jnp.zeros(b.shape, dtype), varying.varying_axes(tokens))
        return _sum(tokens, (0,), dtype)

    if varying.varying_axes(tokens) - vma:
        # Under shard_map, an invariant bias next to sharded tokens: the devices' float32 sums are
        # combined by the canonical tree (tree_psum, never psum), then rounded once.
        db = tree.match_varying(db_in(_F32), vma).astype(b.dtype)
    else:
        db = tree.match_varying(db_in(b.dtype), vma)
    return dx, db


_bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)


def bias_add(x, b):
    """``x + b`` over the last axis, whose bias gradient is the canonical sum over tokens.

    Args:
      x: ``[..., N]`` float32, bfloat16 or float16.
      b: ``[N]``, of x's dtype.

    Returns ``x + b`` (x's shape and dtype). Reverse-mode differentiable (``jax.custom_vjp``):
    ``dx = g``; ``db`` is :func:`jaxdet.sum`'s canonical sum of g over every leading dimension (the
    tokens, flattened row-major), rounded once to b's dtype. Inside ``jax.shard_map`` with x
    sharded over tokens and b replicated, the devices' float32 sums are combined by the canonical
    tree, so db is the single-device bits whenever every device holds 2^j whole chunks of
    ``jaxdet.sum.CHUNK_TOKENS`` tokens; under sharded ``jax.jit`` the same holds by the sum's own
    partitioning rule.
    """
    x_dtype = _float_input(x, "x", "jaxdet.bias_add")
    b_dtype = _float_input(b, "b", "jaxdet.bias_add")
    if x_dtype != b_dtype:
        raise TypeError(
            f"jaxdet.bias_add: x and b must have the same dtype, got {x_dtype.name} and {b_dtype.name}; "
            "cast one of them explicitly"
        )
    if len(x.shape) < 1:
        raise ValueError("jaxdet.bias_add: x must have at least one dimension (x[..., N]), got a scalar")
    n = x.shape[-1]
    if tuple(b.shape) != (n,):
        raise ValueError(f"jaxdet.bias_add: b must have shape ({n},) (the last dimension of x), got {tuple(b.shape)}")
    return autodiff.reverse_only("jaxdet.bias_add", _bias_add, jnp.asarray(x), jnp.asarray(b))


autodiff.refuse_jvp(globals(), lambda params: "jaxdet.bias_add")

# The public function carries its constants (jaxdet.sum.CHUNK_TOKENS).
sum.CHUNK_TOKENS = CHUNK_TOKENS
sum.SUPPORTED_DTYPES = SUPPORTED_DTYPES
