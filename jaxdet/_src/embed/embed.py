"""Embedding lookups whose table gradient is a deterministic segment sum (docs/embed.md).

XLA's scatter-add (the VJP of ``jnp.take``) adds the rows of one table row's tokens in an order
that depends on the GPU's atomics and on the batch. jaxdet's segment sum follows dB's rule
(``jaxdet.matmul_weight_grad``) instead:

* For a segment ``v``, the tokens ``t`` (row-major index of the update rows) with ``ids[t] == v``
  are cut into chunks of ``CHUNK_TOKENS`` by absolute token index (chunk ``t // CHUNK_TOKENS``).
  Each chunk folds its tokens in ascending ``t`` in float32 from +0 (one IEEE add each, no FMA);
  the chunk partials (an empty chunk's is +0) are combined by the canonical tree
  (``jaxdet.parallel.tree_sum``'s), in float32, and the root is cast once (RNE) to the output dtype.
* It is what the CPU GEMM computes for ``matmul_weight_grad(one_hot(ids), x)``, so the two agree
  bitwise there (finite inputs), and micro-batches (or devices) of 2^j whole chunks combined by
  ``tree_sum`` (``tree_psum``) reproduce the whole batch.

How it runs: a stable sort of the token indices by id (XLA's sort, deterministic) in JAX; the FFI
target ``jaxdet_segment_sum`` then finds each segment's tokens in that order (a binary search) and
folds them in order (cuda/embed/).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdet._src.core import autodiff, batching, checks, ffi, tree, varying
from jaxdet._src.core.checks import FLOAT_DTYPES, check_static_int, float_dtype_of
from jaxdet._src.matmul.matmul import WGRAD_CHUNK_TOKENS

__all__ = ["embed", "segment_sum", "CHUNK_TOKENS", "SUPPORTED_DTYPES"]

# The chunk of the rule: the same as dB's (a token's chunk is t // CHUNK_TOKENS), so an embedding
# table's gradient and a one-hot matmul's dB are the same sum, and micro-batches of 2^j chunks line
# up with both.
CHUNK_TOKENS = WGRAD_CHUNK_TOKENS

SUPPORTED_DTYPES = FLOAT_DTYPES
_F32 = np.dtype(jnp.float32)
_I32_LIMIT = 2**31


# ---- Primitive 1: jaxdet_segment_sum (the FFI target). data [L, T, D], sorted_ids s32[L, T] (each
# row's ids in ascending order), order s32[L, T] (the token indices in that order, ascending t among
# equal ids) -> [L, num_segments, D] of out_dtype. Segment v owns the tokens whose sorted ids lie
# in [v, v + 1) (the handlers find the range by binary search); ids outside [0, V) are in none. ----


def _ffi_abstract_eval(data, sorted_ids, order, *, num_segments, out_dtype, chunk_tokens):
    return jax.core.ShapedArray((data.shape[0], num_segments, data.shape[2]), out_dtype)


def _fold_mapped_axis(args, dims):
    """Every operand with the vmapped axis moved to the front and folded into L: [size * L, ...]."""
    size, moved = batching.to_front(args, dims)
    L = moved[0].shape[1]
    return size, L, [x.reshape((size * L,) + x.shape[2:]) for x in moved]


def _ffi_batch(args, dims, **params):
    size, L, flat = _fold_mapped_axis(args, dims)
    out = segment_sum_ffi_p.bind(*flat, **params)
    return out.reshape((size, L) + out.shape[1:]), 0


def _ffi_workspace(avals, *, num_segments, **params):
    # The CUDA handler's int32 offsets of the segments in the sorted order, L * (V + 1) of them.
    return 4 * avals[0].shape[0] * (num_segments + 1)


segment_sum_ffi_p = ffi.define_primitive(
    "jaxdet_segment_sum",
    _ffi_abstract_eval,
    attributes=lambda num_segments, out_dtype, chunk_tokens: dict(chunk_tokens=np.int64(chunk_tokens)),
    batching_rule=_ffi_batch,
    cuda_workspace=_ffi_workspace,
)


def _segment_sum_local(data, ids, num_segments, out_dtype):
    """The FFI call on one device: data [L, T, D], int32 ids [L, T] -> [L, num_segments, D]. The
    tokens are sorted by id with XLA's stable sort (deterministic, and a stable sort's result is
    unique), so each segment's tokens stay in ascending t."""
    positions = lax.broadcasted_iota(jnp.int32, ids.shape, 1)
    sorted_ids, order = lax.sort((ids, positions), dimension=1, is_stable=True, num_keys=1)
    return segment_sum_ffi_p.bind(
        data,
        sorted_ids,
        order,
        num_segments=num_segments,
        out_dtype=np.dtype(out_dtype),
        chunk_tokens=CHUNK_TOKENS,
    )


# ---- Primitive 2: jaxdet_embed_segment_sum (composite, for its batching and partitioning rules).
# data [L, T, D], int32 ids [L, T] (anything outside [0, V) contributes nothing), and optionally a
# `like` operand [V, D] (the embedding table) whose sharding the result's rows and columns take.
# -> [L, V, D] of out_dtype. Under sharded jit: tokens split over devices holding 2^j whole chunks
# each reduce their own chunks, and the float32 partials meet by the canonical tree
# (`tree_psum_untyped`, the top levels of the same tree), so the bits are the unsplit call's;
# other token splits are all-gathered. Rows (V, through `like`), columns (D) and the batch (L)
# run per device with no collective. ----


def _composite_abstract_eval(data, ids, *like, num_segments, out_dtype):
    return jax.core.ShapedArray((data.shape[0], num_segments, data.shape[2]), out_dtype)


def _composite_batch(args, dims, *, num_segments, out_dtype):
    data, ids = args[:2]
    params = dict(num_segments=num_segments, out_dtype=out_dtype)
    if batching.not_mapped(dims[0]) and batching.not_mapped(dims[1]):
        # Only the sharding hint is batched: the sum itself is the same for every example.
        return segment_sum_p.bind(data, ids, **params), None
    # The vmapped axis joins L (each example sums its own tokens); the hint is dropped.
    size, L, flat = _fold_mapped_axis([data, ids], dims[:2])
    out = segment_sum_p.bind(*flat, **params)
    return out.reshape((size, L) + out.shape[1:]), 0


def _composite_factors(params, shapes):
    operands = [("l", "t", "d"), ("l", "t")] + ([("v", "d")] if len(shapes) > 2 else [])
    return operands, [("l", "v", "d")]


def _axis_position(names):
    return lax.axis_index(names if len(names) > 1 else names[0])


def _composite_local(params, axes, shapes):
    num_segments, out_dtype = params["num_segments"], params["out_dtype"]
    tokens, rows = axes.get("t", ()), axes.get("v", ())

    def run(data, ids, *like):
        segments = num_segments
        if rows:  # this device's rows [start, start + segments): the others' ids contribute nothing
            segments = num_segments // math.prod(lax.axis_size(n) for n in rows)
            start = _axis_position(rows) * segments
            ids = jnp.where((ids >= start) & (ids < start + segments), ids - start, -1)
        return tree.reduce_over_devices(lambda dt: _segment_sum_local(data, ids, segments, dt), tokens, out_dtype)

    return run


# A split of the reduced dimension only along whole subtrees of its chunk tree.
_TOKEN_SPLIT = tree.whole_chunk_split("t", CHUNK_TOKENS)
segment_sum_p = ffi.define_composite(
    "jaxdet_embed_segment_sum",
    _composite_abstract_eval,
    ffi.Partitioning(_composite_factors, reduced=frozenset({"t"}), local=_composite_local, can_split=_TOKEN_SPLIT),
    batching_rule=_composite_batch,
)


# ---- The differentiable pair: the segment sum and the row gather are each other's transposes, so
# every backward is made of these custom_vjp functions again and derivatives of any order stay
# deterministic (no XLA scatter-add anywhere). ----


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _segsum(data, ids, like, num_segments, out_dtype, data_dtype, data_vma):
    """data [T, D], int32 ids [T] (outside [0, V) contributes nothing), like: None or the table
    [V, D] (a sharding hint) -> [V, D] of out_dtype, by the rule."""
    if data.shape[0] == 0 or data.shape[1] == 0 or num_segments == 0:  # nothing to sum, or nowhere to
        zeros = jnp.zeros((num_segments, data.shape[1]), out_dtype)
        return tree.match_varying(zeros, varying.varying_union(data, ids))
    operands = (data[None], ids[None]) + (() if like is None else (like,))
    return segment_sum_p.bind(*operands, num_segments=num_segments, out_dtype=np.dtype(out_dtype))[0]


def _segsum_fwd(data, ids, like, num_segments, out_dtype, data_dtype, data_vma):
    return _segsum(data, ids, like, num_segments, out_dtype, data_dtype, data_vma), ids


def _segsum_bwd(num_segments, out_dtype, data_dtype, data_vma, ids, g):
    # d data[t] = g[ids[t]] (+0 for an id outside [0, V)): a gather, whose transpose is _segsum.
    g = g.astype(data_dtype)
    ddata = tree.cotangent(lambda dt: _take(g.astype(dt), ids, False), data_dtype, data_vma, (g, ids))
    return ddata, None, None


_segsum.defvjp(_segsum_fwd, _segsum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _take(table, ids, nan_fill):
    """table [V, D] rows at ids (any int shape) -> [..., D]. nan_fill: exactly ``jnp.take(table, ids,
    axis=0)`` (negative ids in [-V, 0) count from the end, other out-of-range ids give NaN rows);
    otherwise ids are int32 already normalised and out-of-range ids give +0 rows."""
    if nan_fill:
        return jnp.take(table, ids, axis=0)
    valid = (ids >= 0) & (ids < table.shape[0])
    rows = jnp.take(table, jnp.where(valid, ids, 0), axis=0)
    return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


def _take_fwd(table, ids, nan_fill):
    return _take(table, ids, nan_fill), (table, ids)


def _take_bwd(nan_fill, res, g):
    # d table = the segment sum of the cotangent rows by id (negative ids wrapped as the forward
    # did), computed by the rule and cast once to the table's dtype.
    table, ids = res
    V, D = table.shape
    table_dtype, table_vma = table.dtype, varying.varying_axes(table)
    flat = _segment_ids(ids, V, wrap=nan_fill)
    rows = g.astype(table_dtype).reshape(-1, D)
    g_vma = varying.varying_axes(rows)

    def compute(dt):
        return _segsum(rows, flat, table, V, dt, table_dtype, g_vma)

    return tree.cotangent(compute, table_dtype, table_vma, (rows, flat)), None


_take.defvjp(_take_fwd, _take_bwd)


# ---- Checks and the public functions. ----


def _check_ids(ids, name):
    if not (hasattr(ids, "dtype") and hasattr(ids, "shape")):
        raise TypeError(f"{name} must be an integer JAX or NumPy array, got {type(ids).__name__}")
    dtype = np.dtype(ids.dtype)
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(f"{name} must be an integer array, got {dtype.name}")
    return jnp.asarray(ids)


def _segment_ids(ids, num_segments, wrap):
    """int32 [T] (flattened row-major): ids in [0, num_segments) as they are, every other id -1.
    wrap: a negative id in [-num_segments, 0) counts from the end first (``jnp.take``'s rule)."""
    ids = jnp.asarray(ids)
    if jnp.issubdtype(ids.dtype, jnp.signedinteger):
        wide = ids if ids.dtype.itemsize >= 4 else ids.astype(jnp.int32)
        if wrap:
            wide = jnp.where(wide < 0, wide + num_segments, wide)
        valid = (wide >= 0) & (wide < num_segments)
    else:
        wide = ids if ids.dtype.itemsize >= 4 else ids.astype(jnp.uint32)
        valid = wide < num_segments
    return jnp.where(valid, wide, -1).astype(jnp.int32).reshape(-1)


def segment_sum(data, segment_ids, num_segments, *, preferred_element_type=None):
    """Deterministic segment sum: ``out[v] = sum of data[t] over the tokens t with segment_ids[t] == v``.

    Args:
      data: ``[*T, D]`` float32, bfloat16 or float16: one row of D values per token (all leading
        dims are tokens, flattened row-major: token t is the t-th row).
      segment_ids: integer ``[*T]``, the segment of each token. Ids outside ``[0, num_segments)``
        (negative ones included) contribute nothing.
      num_segments: the number of segments V, a static Python int >= 1.
      preferred_element_type: None (the result in data's dtype) or ``jnp.float32`` (the float32
        root, for combining micro-batches with ``jaxdet.parallel.tree_sum``).

    Returns ``[num_segments, D]``: per segment, its tokens cut into chunks of ``CHUNK_TOKENS`` by
    absolute token index, each chunk folded in ascending t in float32 from +0, the chunk partials
    (an empty chunk's is +0) combined by the canonical tree (``jaxdet.parallel.tree_sum``'s), cast
    once (round to nearest even). A segment with no tokens is +0. The bits depend on the segment's
    own tokens (values and positions) only: not on the other segments, V, the device count or the
    backend; ``jaxdet.matmul_weight_grad(jax.nn.one_hot(ids, V), data)`` gives the same bits on the
    CPU. Micro-batches of 2^j whole chunks each (float32 results) combined with
    ``jaxdet.parallel.tree_sum`` reproduce the whole batch (docs/embed.md). Reverse-mode
    differentiable to any order (``d data = g[segment_ids]``, +0 rows for ids out of range).

    Raises TypeError for a non-float ``data``, non-integer ``segment_ids``, a traced or non-int
    ``num_segments`` and a bad ``preferred_element_type``; ValueError for mismatched shapes and
    ``num_segments`` < 1 or >= 2^31.
    """
    dtype = float_dtype_of(data, "data")
    ids = _check_ids(segment_ids, "segment_ids")
    num_segments = check_static_int(num_segments, "num_segments", minimum=1)
    if num_segments >= _I32_LIMIT:
        raise ValueError(f"num_segments must be < 2^31, got {num_segments}")
    out_dtype = checks.accumulated_result_dtype(dtype, preferred_element_type, "preferred_element_type")
    d_shape, i_shape = tuple(data.shape), tuple(ids.shape)
    if len(d_shape) != len(i_shape) + 1 or d_shape[:-1] != i_shape:
        raise ValueError(
            f"data must be [*T, D] for segment_ids [*T] (one row of data per id), got data{list(d_shape)} "
            f"segment_ids{list(i_shape)}"
        )
    T, D = math.prod(i_shape), d_shape[-1]
    if T >= _I32_LIMIT:
        raise ValueError(f"segment_sum takes fewer than 2^31 tokens, got {T}")
    data = jnp.asarray(data)
    data_vma = varying.varying_axes(data)
    if T == 0 or D == 0:
        return tree.match_varying(jnp.zeros((num_segments, D), out_dtype), varying.varying_union(data, ids))
    flat = _segment_ids(ids, num_segments, wrap=False)
    return autodiff.reverse_only(
        "jaxdet.segment_sum",
        _segsum,
        data.reshape(T, D),
        flat,
        None,
        num_segments,
        out_dtype,
        dtype,
        data_vma,
        higher_order=True,
    )


def embed(table, ids):
    """Embedding lookup ``jnp.take(table, ids, axis=0)`` whose table gradient is deterministic.

    Args:
      table: ``[V, D]`` float32, bfloat16 or float16.
      ids: integer array of any shape.

    Returns ``[*ids.shape, D]``, exactly ``jnp.take(table, ids, axis=0)``: row ``ids[...]`` of the
    table; a negative id in ``[-V, 0)`` counts from the end, and any other id outside ``[0, V)``
    gives a row of NaN (``jnp.take``'s default ``mode="fill"``).

    The table's cotangent is ``segment_sum(g, ids, V)`` of the output cotangent rows ``g`` (negative
    ids wrapped as in the forward; ids out of range contribute nothing), by the rule of
    ``segment_sum``: float32 chunk folds of ``CHUNK_TOKENS`` tokens, the canonical tree, cast once
    to the table's dtype. So it is batch invariant in the sense of ``matmul_weight_grad``'s dB
    (padding tokens with zero cotangents change no bit; micro-batches or devices of 2^j whole
    chunks reproduce the batch) and equals the one-hot matmul's dB on the CPU. ``ids`` gets no
    cotangent (it is an integer input). Reverse-mode differentiable to any order; no forward mode.
    Inside ``jax.shard_map`` a table that does not vary over an axis the tokens vary over gets the
    canonical tree of the devices' float32 partials (``jaxdet.parallel.tree_psum``), cast once;
    under sharded ``jax.jit`` see docs/embed.md.

    Raises TypeError for a non-float ``table`` or non-integer ``ids``, ValueError for a table that
    is not 2-D or has 2^31 rows or more.
    """
    float_dtype_of(table, "table")
    ids = _check_ids(ids, "ids")
    if len(table.shape) != 2:
        raise ValueError(f"table must be [V, D] (one row per id), got table{list(table.shape)}")
    if table.shape[0] >= _I32_LIMIT:
        raise ValueError(f"table must have fewer than 2^31 rows, got {table.shape[0]}")
    table = jnp.asarray(table)
    return autodiff.reverse_only("jaxdet.embed", _take, table, ids, True, higher_order=True)


autodiff.refuse_jvp(globals(), lambda params: "jaxdet.embed / jaxdet.segment_sum")

# The public functions carry the rule's constants (docs/embed.md).
embed.CHUNK_TOKENS = CHUNK_TOKENS
embed.SUPPORTED_DTYPES = SUPPORTED_DTYPES
segment_sum.CHUNK_TOKENS = CHUNK_TOKENS
segment_sum.SUPPORTED_DTYPES = SUPPORTED_DTYPES
