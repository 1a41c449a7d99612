"""Fused attention whose rows are batch-invariant and prefill/decode-invariant, forward and backward.

The contracts (docs/attention.md, proven by tests/test_attention.py):

* Row invariance. The output for a query depends only on that query, on its own sequence's keys
  and values at positions ``0 .. limit - 1`` (``limit`` = its position + 1 when causal, capped by
  the sequence's ``kv_length``) and on ``scale``: not on the batch, the row's place in it,
  padding, packing (``segment_ids``), the query chunk it is computed in, the KV cache's capacity,
  vmap or jit.
* Prefill/decode invariance. That includes the query chunk: a full causal pass, chunked prefill
  with any chunk boundaries and single-query decode steps against a KV cache (``q_positions``,
  ``kv_lengths``) give every query position the same bits, because every row runs the canonical
  order of docs/attention.md: KV blocks of ``KV_BLOCK`` positions from position 0, grouped in
  splits of ``KV_SPLIT``, an online softmax over the blocks of a split, the splits merged in
  ascending order.
* Backward. dQ rows have the same invariance; dK and dV are deterministic (a fixed order over the
  query rows, no atomics).
* Derivatives to any order, forward and reverse (docs/derivatives.md): the tangent is a linear map
  of jaxdet products whose transpose is the backward kernel; its rows are invariant as the
  output's, and a decode step's tangent is the full pass's.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdet import _native
from jaxdet._src.core import autodiff, batching, ffi, tree, varying
from jaxdet._src.core.checks import FLOAT_DTYPES, check_static_float, float_dtype_of
from jaxdet._src.matmul.matmul import matmul
from jaxdet._src.reduce.reduce import sum as canonical_sum

__all__ = ["attention", "KV_BLOCK", "KV_SPLIT", "SUPPORTED_HEAD_DIMS", "KERNEL_HEAD_DIMS"]

KV_BLOCK = 64  # kBlock in cuda/attention/attention_math.h
KV_SPLIT = 512  # kSplit in cuda/attention/attention_math.h
KERNEL_HEAD_DIMS = (64, 128, 256)  # the kernels' own (cuda/attention: kHeadDims)
# Other head dimensions run on the next kernel's: q, k and v padded with zero columns. A zero
# column adds +0 to each score, which changes no bit, and its output column is dropped.
SUPPORTED_HEAD_DIMS = tuple(range(32, 257, 16))
SUPPORTED_DTYPES = FLOAT_DTYPES
# Forward mode computes the tangent in blocks of query positions whose float32 scores
# [B, K, T_block * G, S] take at most this many bytes (at least one position per block).
TANGENT_BLOCK_BYTES = 256 * 2**20
_LOG2E = 1.4426950408889634


# ---- The primitives. q [B, T, H, G, D] (query head h*G + g uses KV head h), k and v [B, S, H, D].
# Query (b, t) sees memory rows kv_start .. kv_start + limit - 1 of its batch element's keys, its
# sequence's positions 0 .. limit - 1, described by two int32 operands (row_a, row_b) in the form
# `row_form` (RowForm in cuda/attention/attention_ffi.h, where the kernels compute the pair):
# START_LIMIT: row_a [B, T] = kv_start, row_b [B, T] = limit (packed segments);
# CAUSAL_POSITIONS: row_a [B, T] = q_positions, row_b [B] = kv_lengths;
# LENGTHS: row_a [B, 0], row_b [B] = kv_lengths (not causal).
# The positions forms take a decode step's q_positions and kv_lengths as they are: no kernel runs
# before the attention's to describe the rows. ----

START_LIMIT, CAUSAL_POSITIONS, LENGTHS = 0, 1, 2


def _fwd_abstract_eval(q, k, v, row_a, row_b, *, scale, row_form):
    B, T, H, G, _ = q.shape
    return (jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray((B, H, T, G), jnp.float32))


def _bwd_abstract_eval(q, k, v, o, lse2, do, row_a, row_b, *, scale, row_form):
    return (
        jax.core.ShapedArray(q.shape, q.dtype),
        jax.core.ShapedArray(k.shape, k.dtype),
        jax.core.ShapedArray(v.shape, v.dtype),
    )


def _fold_batch(args, dims):
    """The vmapped axis of every operand moved to the front and folded into B (an unmapped operand
    is broadcast). Rows are independent, so the bits of every row are those of the unbatched call."""
    size, moved = batching.to_front(args, dims)
    return size, [x.reshape((size * x.shape[1],) + x.shape[2:]) for x in moved]


def _unfold(size, outs):
    return [batching.unfold(o, size) for o in outs], [0] * len(outs)


def _fwd_batch(args, dims, **params):
    size, flat = _fold_batch(args, dims)
    return _unfold(size, fwd_p.bind(*flat, **params))


def _bwd_batch(args, dims, **params):
    size, flat = _fold_batch(args, dims)
    return _unfold(size, bwd_p.bind(*flat, **params))


def _scale_log2(scale):
    return np.float32(np.float64(scale) * _LOG2E)


def _row_factors(row_form):
    if row_form == START_LIMIT:
        return [("b", "t"), ("b", "t")]
    return [("b", "t") if row_form == CAUSAL_POSITIONS else ("b", "e"), ("b",)]


def _fwd_factors(params, shapes):
    # Batch, query rows (t), KV heads and query heads per KV head are split per device with no
    # collective: each row's description is its own and it sees its sequence's whole keys, so the
    # keys' sequence (s) and the head dimension are never split (a split one is all-gathered).
    q = ("b", "t", "h", "g", "d")
    kv = ("b", "s", "h", "d")
    return [q, kv, kv, *_row_factors(params["row_form"])], [q, ("b", "h", "t", "g")]


def _bwd_factors(params, shapes):
    # dk and dv sum over the query rows and the query heads of a KV head, so t and g stay whole
    # too (a psum would make the order depend on the device count).
    q = ("b", "t", "h", "g", "d")
    kv = ("b", "s", "h", "d")
    return [q, kv, kv, q, ("b", "h", "t", "g"), q, *_row_factors(params["row_form"])], [q, kv, kv]


def _symbolic_dims(*dims):
    """The names of the dimensions among `dims` that are symbolic (``jax.export.symbolic_shape``)."""
    return [str(d) for d in dims if not isinstance(d, (int, np.integer))]


def _static_dims(q, k):
    """q's and k's dims as ints; a clear error for symbolic ones: the CUDA kernels' workspace and
    split plan are sized from the shapes when the program is compiled (the CPU kernels need
    neither, so ``jax.export`` with symbolic sequence lengths works for platforms=["cpu"])."""
    for name, x in (("q", q), ("k", k)):
        symbolic = _symbolic_dims(*x.shape)
        if symbolic:
            raise ValueError(
                f"jaxdet.attention on CUDA needs static shapes: {name} has symbolic dimension(s) "
                f"{', '.join(symbolic)} (jax.export.symbolic_shape). The CUDA kernels' workspace and "
                "split plan depend on the batch, sequence lengths and heads; export for CUDA with "
                "concrete shapes (one export per sequence-length bucket), or for platforms=['cpu']"
            )


def _workspace(pass_):
    """The CUDA kernels' workspace in bytes (cuda/attention/attention_workspace.h), from the
    shapes of q and k."""

    def size(avals, **params):
        q, k = avals[0], avals[1]
        _static_dims(q, k)
        B, T, H, G, D = q.shape
        tensor_cores = q.dtype != jnp.float32
        return _native.attention_workspace_bytes(pass_, B, T, H, G, D, k.shape[1], tensor_cores)

    return size


def _split_mode(q, k):
    _static_dims(q, k)
    B, T, H, G, D = q.shape
    return _native.attention_forward_splits(B, T, H, G, D, k.shape[1], q.dtype != jnp.float32) > 0


def _fwd_cuda_aliases(avals, **params):
    """The output in q's buffer where the CUDA forward runs in split mode, which writes the output
    only after every read of q (by CombineKernel, or by a cluster's CTAs after their barrier): a
    decode step whose query is not needed after it (a generation loop's carry, a projection's
    result) then needs no buffer or copy for its output. XLA copies q first where it is still
    needed (a jitted call's undonated argument, the residual the backward keeps)."""
    return {0: 0} if _split_mode(avals[0], avals[1]) else None


fwd_p = ffi.define_primitive(
    "jaxdet_attention_fwd",
    _fwd_abstract_eval,
    attributes=lambda scale, row_form: dict(scale_log2=_scale_log2(scale), row_form=np.int32(row_form)),
    batching_rule=_fwd_batch,
    multiple_results=True,
    partitioning=ffi.Partitioning(_fwd_factors, replicated=frozenset({"s", "d", "e"})),
    cuda_workspace=_workspace("fwd"),
    cuda_operand_output_aliases=_fwd_cuda_aliases,
)

bwd_p = ffi.define_primitive(
    "jaxdet_attention_bwd",
    _bwd_abstract_eval,
    attributes=lambda scale, row_form: dict(
        scale_log2=_scale_log2(scale), scale=np.float32(scale), row_form=np.int32(row_form)
    ),
    batching_rule=_bwd_batch,
    multiple_results=True,
    partitioning=ffi.Partitioning(_bwd_factors, replicated=frozenset({"s", "d", "e", "t", "g"})),
    cuda_workspace=_workspace("bwd"),
)


def _typed_like(ct, primal):
    """A cotangent with its primal's varying axes (jax.shard_map): axes only the cotangent varies
    over (keys and values invariant next to varying queries) are summed by the canonical tree in
    float32 (never a psum), then cast once."""
    vma = varying.varying_axes(primal)
    if varying.varying_axes(ct) - vma:
        return tree.match_varying(ct.astype(jnp.float32), vma).astype(ct.dtype)
    return tree.match_varying(ct, vma)


# ---- The differentiable core. The primal is the forward kernel; the tangent of o in (tq, tk, tv)
# is a linear map whose transpose is the backward kernel, so jax.grad runs exactly that kernel.
# With P the probabilities of a query's visible keys (exactly 0 on the others):
#   ds_j = scale (tq . k_j + q . tk_j),  c = sum_j P_j ds_j,
#   to = sum_j P_j (ds_j - c) v_j + sum_j P_j tv_j.
# Per (batch element, KV head) the rows are the T * G queries and the columns the S keys; every
# dot product (over D, over keys, over query rows) is a jaxdet.matmul and c is a jaxdet.sum, so a
# tangent row depends only on its query, its sequence's keys and the tangents (docs/derivatives.md,
# "Row contracts in tangents"). The kernels' own derivatives (second order) are those of their
# formulas (`_fwd_formula`, `_bwd_formula`) written with the same operations. ----

_F32 = np.dtype(np.float32)


def _query_rows(x):
    """[B, T, H, G, D] -> [B, H, T * G, D] in float32: each KV head's queries as GEMM rows."""
    B, T, H, G, D = x.shape
    return x.astype(_F32).transpose(0, 2, 1, 3, 4).reshape(B, H, T * G, D)


def _from_query_rows(x, shape):
    B, T, H, G, D = shape
    return x.reshape(B, H, T, G, D).transpose(0, 2, 1, 3, 4)


def _visible(row_a, row_b, row_form, shape, S):
    """(per query row [B, 1, T * G, S], per key [B, 1, S, 1]): whether the query sees the key, and
    whether any query of the batch element does."""
    B, T, H, G, _ = shape
    start, limit = _row_ranges(row_a, row_b, row_form, B, T, S)
    return _visible_rows(start, limit, G, S), _seen_keys(start, limit, S)


def _key_rows(x, seen):
    """[B, S, H, D] -> [B, H, S, D] in float32, zero at the keys no query sees (unused KV cache
    capacity is never read into a result, whatever it holds, as in the kernels)."""
    return jnp.where(seen, x.astype(_F32).transpose(0, 2, 1, 3), 0.0)


def _mm(a, b):
    return matmul(a, b, preferred_element_type=_F32)


def _t(x):
    return jnp.swapaxes(x, -1, -2)


def _probabilities(q_rows, k_rows, lse2, vis, scale):
    """P [B, H, T * G, S] = exp2(scale_log2 * q . k - lse2) on the visible keys, exactly 0 on the
    others and on rows with no visible key (whose lse2 is -inf): no inf or NaN reaches a tangent."""
    # scale_log2 multiplies q before the product, so no multiply-add of the scores can be fused.
    x = _mm(q_rows * _scale_log2(scale), _t(k_rows))
    B, H, T, G = lse2.shape
    lse2 = lse2.reshape(B, H, T * G, 1)
    lse2 = jnp.where(jnp.isfinite(lse2), lse2, 0.0)
    return jnp.where(vis, jnp.exp2(jnp.where(vis, x - lse2, 0.0)), 0.0)


def _tangent_query_block(B, T, H, G, S):
    """T_block: the most query positions whose float32 scores fit in TANGENT_BLOCK_BYTES (at least 1,
    at most T)."""
    per_position = B * H * G * S * _F32.itemsize
    return max(1, min(T, TANGENT_BLOCK_BYTES // max(per_position, 1)))


def _seen_keys(start, limit, S):
    """[B, 1, S, 1]: whether any query of the batch element sees the key, from the rows' ranges by
    a difference array: O(B (T + S)) memory, no [T, S] mask."""
    B = start.shape[0]
    b = jnp.arange(B, dtype=jnp.int32)[:, None]
    edges = jnp.zeros((B, S + 1), jnp.int32).at[b, start].add(1).at[b, start + limit].add(-1)
    return (jnp.cumsum(edges[:, :S], axis=1) > 0)[:, None, :, None]


def _visible_rows(start, limit, G, S):
    """[B, 1, T * G, S]: whether each query row sees each key."""
    B, T = start.shape
    s = jnp.arange(S, dtype=jnp.int32)
    vis = (s >= start[:, :, None]) & (s < (start + limit)[:, :, None])  # [B, T, S]
    return jnp.broadcast_to(vis[:, None, :, None, :], (B, 1, T, G, S)).reshape(B, 1, T * G, S)


def _tangent_fn(scale, row_form, which):
    """The tangent of o in the tangents named by `which` (a subset of "q", "k", "v").

    Every step is per query row (products over D or over the keys of a row, the row's sum), so the
    rows are computed in blocks of query positions (`_tangent_query_block`, a `lax.map` over the
    blocks) with the bits of one block: memory O(B N T_block S). The keys, values and their
    tangents are shared by every block. The last block is padded with rows that see no key, which
    are dropped."""

    def block(k_rows, v_rows, tk_rows, tv_rows, q, lse2, start, limit, tq):
        # q, tq [B, T_b, H, G, D], lse2 [B, H, T_b, G], start and limit [B, T_b]: one block's rows.
        vis = _visible_rows(start, limit, q.shape[3], k_rows.shape[2])
        q_rows = _query_rows(q)
        p = _probabilities(q_rows, k_rows, lse2, vis, scale)
        parts = []
        if "q" in which or "k" in which:
            # ds = [s tq | s q] . [k | tk]^T: one product, no sum of two rounded terms.
            lhs, rhs = [], []
            if "q" in which:
                lhs.append(_query_rows(tq) * np.float32(scale))
                rhs.append(k_rows)
            if "k" in which:
                lhs.append(q_rows * np.float32(scale))
                rhs.append(tk_rows)
            ds = _mm(jnp.concatenate(lhs, -1), _t(jnp.concatenate(rhs, -1)))
            c = canonical_sum(jnp.where(vis, p * ds, 0.0), axis=-1, keepdims=True)
            a = jnp.where(vis, p * (ds - c), 0.0)
            parts.append(_mm(a, v_rows))
        if "v" in which:
            parts.append(_mm(p, tv_rows))
        # Two products' float32 results added once (no multiply to contract with), then rounded.
        do = parts[0] if len(parts) == 1 else parts[0] + parts[1]
        return _from_query_rows(do, q.shape).astype(q.dtype)

    def fn(q, k, v, o, lse2, row_a, row_b, *lin):
        symbolic = _symbolic_dims(*q.shape, k.shape[1])
        if symbolic:
            raise NotImplementedError(
                "forward-mode differentiation (jax.jvp, jax.linearize, jax.jacfwd) of jaxdet.attention needs "
                f"static shapes, got symbolic dimension(s) {', '.join(symbolic)} (jax.export.symbolic_shape); "
                "reverse mode (jax.grad, jax.vjp) exports with symbolic shapes"
            )
        t = dict(zip(which, lin))
        B, T, H, G, _ = q.shape
        S = k.shape[1]
        start, limit = _row_ranges(row_a, row_b, row_form, B, T, S)
        seen = _seen_keys(start, limit, S)
        shared = [_key_rows(x, seen) if x is not None else None for x in (k, v, t.get("k"), t.get("v"))]
        tq = t.get("q")
        Tb = _tangent_query_block(B, T, H, G, S)
        if Tb >= T:
            return (block(*shared, q, lse2, start, limit, tq),)
        n = -(-T // Tb)
        pad = n * Tb - T

        def blocks(x, axis):
            # [..., T, ...] -> [n, ..., Tb, ...]: the rows padded at the end of the axis to n * Tb
            # (a padded row has limit 0: it sees no key, so its scores are zeros, never inf or NaN).
            x = jnp.pad(x, [(0, pad if i == axis else 0) for i in range(x.ndim)])
            x = x.reshape(x.shape[:axis] + (n, Tb) + x.shape[axis + 1 :])
            return jnp.moveaxis(x, axis, 0)

        xs = [blocks(q, 1), blocks(lse2, 2), blocks(start, 1), blocks(limit, 1), None if tq is None else blocks(tq, 1)]
        out = lax.map(lambda x: block(*shared, *x), xs)  # [n, B, Tb, H, G, D]
        out = jnp.moveaxis(out, 0, 1).reshape((B, n * Tb) + out.shape[3:])
        return (out[:, :T],)

    return fn


def _transpose_fn(scale, row_form, which):
    """The backward kernel, returning the cotangents of the tangents named by `which`."""

    def transpose(q, k, v, o, lse2, row_a, row_b, do):
        grads = bwd_p.bind(q, k, v, o, lse2, do.astype(q.dtype), row_a, row_b, scale=scale, row_form=row_form)
        primals = dict(q=q, k=k, v=v)
        return tuple(_typed_like(g, primals[name]) for name, g in zip("qkv", grads) if name in which)

    return transpose


def _fwd_formula(q, k, v, row_a, row_b, *, scale, row_form):
    """(o, lse2) of the forward kernel as a differentiable formula (its value is not used: the JVP
    rule binds the kernel). m, the row's largest visible score, only keeps exp2 in range: lse2
    does not depend on it, so it carries no tangent."""
    vis, seen = _visible(row_a, row_b, row_form, q.shape, k.shape[1])
    x = _mm(_query_rows(q) * _scale_log2(scale), _t(_key_rows(k, seen)))
    m = lax.stop_gradient(jnp.max(jnp.where(vis, x, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(vis, jnp.exp2(jnp.where(vis, x - m, 0.0)), 0.0)
    total = canonical_sum(e, axis=-1, keepdims=True)
    seen_any = total > 0
    total = jnp.where(seen_any, total, 1.0)
    lse2 = jnp.where(seen_any, m + jnp.log2(total), -jnp.inf)
    o = _mm(e / total, _key_rows(v, seen))
    B, T, H, G, _ = q.shape
    return [_from_query_rows(o, q.shape).astype(q.dtype), lse2.reshape(B, H, T, G)]


def _bwd_formula(q, k, v, o, lse2, do, row_a, row_b, *, scale, row_form):
    """(dq, dk, dv) of the backward kernel as a differentiable formula, from its o and lse2
    operands as the kernel uses them: delta = do . o, ds_j = P_j (do . v_j - delta)."""
    vis, seen = _visible(row_a, row_b, row_form, q.shape, k.shape[1])
    q_rows, k_rows, v_rows = _query_rows(q), _key_rows(k, seen), _key_rows(v, seen)
    do_rows = _query_rows(do)
    p = _probabilities(q_rows, k_rows, lse2, vis, scale)
    delta = canonical_sum(do_rows * _query_rows(o), axis=-1, keepdims=True)
    ds = jnp.where(vis, p * (_mm(do_rows, _t(v_rows)) - delta), 0.0)
    s = np.float32(scale)
    dq = _from_query_rows(_mm(ds, k_rows) * s, q.shape)
    dk = (_mm(_t(ds), q_rows) * s).transpose(0, 2, 1, 3)
    dv = _mm(_t(p), do_rows).transpose(0, 2, 1, 3)
    return [dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)]


autodiff.jvp_of_formula(fwd_p, _fwd_formula)
autodiff.jvp_of_formula(bwd_p, _bwd_formula)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6))
def _attention5(q, k, v, row_a, row_b, scale, row_form):
    return fwd_p.bind(q, k, v, row_a, row_b, scale=scale, row_form=row_form)[0]


def _attention5_jvp(scale, row_form, primals, tangents):
    q, k, v, row_a, row_b = primals
    # The residuals: the inputs, the output and the float32 base-2 log-sum-exp per row; the
    # probabilities are recomputed from them, never stored.
    o, lse2 = fwd_p.bind(q, k, v, row_a, row_b, scale=scale, row_form=row_form)
    which = tuple(name for name, t in zip("qkv", tangents[:3]) if not autodiff.is_zero(t))
    if not which:
        return o, jnp.zeros_like(o)
    lin = tuple(t for t in tangents[:3] if not autodiff.is_zero(t))
    res = (q, k, v, o, lse2, row_a, row_b)
    # The tangent has o's type; given, reverse mode never traces the tangent's products (which
    # need static shapes: jax.export with a symbolic length exports the backward kernel alone).
    (to,) = autodiff.linear_call(
        _tangent_fn(scale, row_form, which), _transpose_fn(scale, row_form, which), res, lin, out_avals=(jax.typeof(o),)
    )
    return o, to


_attention5.defjvp(_attention5_jvp, symbolic_zeros=True)


# ---- Which keys each query sees. ----


def _segment_rows(segment_ids, causal):
    """(kv_start, limit) per query of packed sequences: a segment is a run of equal ids; its
    positions restart at 0."""
    T = segment_ids.shape[1]
    idx = jnp.arange(T, dtype=jnp.int32)
    first = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], jnp.bool_), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    start = lax.cummax(jnp.where(first, idx, 0), axis=1)
    if causal:
        return start, idx - start + 1
    last = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1], jnp.ones_like(segment_ids[:, :1], jnp.bool_)], 1)
    end = lax.cummin(jnp.where(last, idx + 1, T), axis=1, reverse=True)
    return start, end - start


def _position_rows(B, T, S, causal, q_positions, kv_lengths):
    """The positions forms: q_positions and kv_lengths as int32, as given where their shapes are
    the kernels' (a decode step's [B, 1] and [B]); the kernels clamp them (RowForm)."""
    kv_len = (
        jnp.full((B,), S, jnp.int32) if kv_lengths is None else jnp.broadcast_to(kv_lengths.astype(jnp.int32), (B,))
    )
    if not causal:
        return jnp.zeros((B, 0), jnp.int32), kv_len, LENGTHS
    pos = jnp.arange(T, dtype=jnp.int32) if q_positions is None else q_positions.astype(jnp.int32)
    return jnp.broadcast_to(pos, (B, T)), kv_len, CAUSAL_POSITIONS


def _mask_rows(xp, mask, B, T, S, causal, q_positions, kv_lengths):
    """(kv_start, limit, ok) per query of a boolean mask ANDed with the causal and length limits,
    computed with `xp` (jax.numpy in the program, NumPy for a mask known at trace time).

    A row whose visible keys are one contiguous run is read as (its first key, the run's length),
    exactly the START_LIMIT description: the canonical order counts its blocks from the first
    visible key, so the row has the bits of the same keys seen from position 0 (a left-padded
    prompt, a decode step's full-length cache, a packed sequence). ``ok`` is False for a row of any
    other form, or whose heads disagree: it has no such description."""
    m = mask
    while m.ndim < 4:
        m = m[None]
    # One description per (b, t) serves every head: a per-head mask must agree across heads.
    agree = xp.all(m == m[:, :1], axis=(1, 3)) if m.shape[1] > 1 else None
    m = xp.broadcast_to(m[:, 0], (B, T, S))
    s = xp.arange(S, dtype=np.int32)
    if causal or kv_lengths is not None:
        kv_len = xp.full((B,), S, np.int32) if kv_lengths is None else xp.broadcast_to(kv_lengths, (B,))
        bound = xp.broadcast_to(kv_len.astype(np.int32)[:, None], (B, T))
        if causal:
            pos = xp.arange(T, dtype=np.int32) if q_positions is None else q_positions.astype(np.int32)
            bound = xp.minimum(bound, xp.broadcast_to(pos, (B, T)) + 1)
        m = m & (s < bound[:, :, None])
    count = xp.sum(m, axis=-1, dtype=np.int32)
    start = xp.where(count > 0, xp.argmax(m, axis=-1).astype(np.int32), 0)
    run = (s >= start[:, :, None]) & (s < (start + count)[:, :, None])
    ok = xp.all(m == run, axis=-1)
    if agree is not None:
        ok = ok & xp.broadcast_to(agree, (B, T))
    return start, count, ok


def _check_mask(mask, B, N, T, S):
    if not (hasattr(mask, "dtype") and hasattr(mask, "shape")):
        raise TypeError(f"mask must be a boolean array, got {type(mask).__name__}")
    if np.dtype(mask.dtype) != np.bool_:
        raise TypeError(f"mask must be a boolean array (True: the query sees the key), got {np.dtype(mask.dtype).name}")
    shape = tuple(mask.shape)
    if len(shape) > 4 or any(d not in (1, f) for d, f in zip(shape[::-1], (B, N, T, S)[::-1])):
        raise ValueError(
            f"mask must broadcast to [B, 1 or N, T, S] = {[B, N, T, S]} (each dim 1 or full), got {list(shape)}"
        )


def _concrete(x):
    return x is None or not isinstance(x, jax.core.Tracer)


def _rows_of_mask(mask, B, T, S, causal, q_positions, kv_lengths):
    """The mask's rows; a mask (and positions) known at trace time with a row of no contiguous
    form is a ValueError naming the row instead of NaN in the output."""
    if all(_concrete(x) for x in (mask, q_positions, kv_lengths)):
        host = [None if x is None else np.asarray(x) for x in (q_positions, kv_lengths)]
        _, _, ok = _mask_rows(np, np.asarray(mask), B, T, S, causal, *host)
        if not ok.all():
            b, t = (int(i) for i in np.argwhere(~ok)[0])
            raise ValueError(
                f"mask: the keys query (batch {b}, position {t}) sees are not one contiguous run (or differ "
                "between heads); jaxdet.attention computes a query over a run of keys, from its first "
                "visible key to its last"
            )
    return _mask_rows(jnp, jnp.asarray(mask), B, T, S, causal, q_positions, kv_lengths)


def _row_ranges(row_a, row_b, row_form, B, T, S):
    """(kv_start, limit) [B, T] of the rows described, clamped as the kernels do (RowForm)."""
    if row_form == CAUSAL_POSITIONS:
        seen = jnp.clip(row_a, -1, S - 1) + 1
        return jnp.zeros_like(row_a), jnp.minimum(seen, jnp.clip(row_b, 0, S)[:, None])
    if row_form == LENGTHS:
        return jnp.zeros((B, T), jnp.int32), jnp.broadcast_to(jnp.clip(row_b, 0, S)[:, None], (B, T))
    start = jnp.clip(row_a, 0, S)
    return start, jnp.clip(row_b, 0, S - start)


def _windowed(row_a, row_b, row_form, B, T, S, q_positions, segment_ids, window):
    """START_LIMIT rows of the rows described, each cut to the keys at memory rows
    ``p - window + 1 .. p`` of its query's row ``p`` (q_positions, else the query's index)."""
    start, limit = _row_ranges(row_a, row_b, row_form, B, T, S)
    if segment_ids is None and q_positions is not None:
        p = jnp.broadcast_to(q_positions.astype(jnp.int32), (B, T))
    else:
        p = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    first = jnp.maximum(start, p - (window - 1))
    return first, jnp.maximum(start + limit - first, 0)


# ---- Checks. ----


def _check_int_array(x, name, shapes, help_):
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        raise TypeError(f"{name} must be an integer array {help_}, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array {help_}, got {np.dtype(x.dtype).name}")
    if tuple(x.shape) not in shapes:
        raise ValueError(f"{name} must have shape {help_}, got {list(x.shape)}")
    return jnp.asarray(x)


def attention(
    q,
    k,
    v,
    *,
    causal: bool = True,
    scale=None,
    q_positions=None,
    kv_lengths=None,
    segment_ids=None,
    mask=None,
    window=None,
):
    """Multi-head attention ``softmax(scale * q k^T + mask) v`` with invariant rows.

    Args:
      q: ``[B, T, N, D]`` queries (or ``[T, N, D]`` with k and v of rank 3 too).
      k, v: ``[B, S, K, D]`` keys and values; ``K`` divides ``N`` (query head ``n`` uses KV head
        ``n // (N // K)``: multi-head, grouped-query or multi-query attention). Same dtype as q:
        float32, bfloat16 or float16; ``D`` in ``SUPPORTED_HEAD_DIMS`` (32 to 256 in steps of 16;
        other than 64, 128, 256 on the next of those kernels with zero columns).
      causal: query at position ``p`` sees keys at positions ``<= p``; otherwise all keys of its
        sequence.
      scale: a Python float (default ``1 / sqrt(D)``).
      q_positions: int ``[B, T]`` (or ``[T]``): the position of each query in its sequence (the
        key row it may see last, when causal). Needed when causal and ``T != S`` (chunked prefill,
        decode against a KV cache); default ``arange(T)``.
      kv_lengths: int ``[B]``: keys at positions ``>= kv_lengths[b]`` are padding (or unused KV
        cache capacity) and are never seen. Default S. Clamped to ``[0, S]``.
      segment_ids: int ``[B, T]`` for packed self-attention (``T == S``): each run of equal ids is
        its own sequence, with positions starting at 0. Excludes q_positions, kv_lengths and mask.
      mask: boolean, broadcastable to ``[B, 1 or N, T, S]`` (True: the query sees the key), ANDed
        with causal, q_positions and kv_lengths. Each query's visible keys must be one contiguous
        run (causal, left or right padding, a decode step's full-length cache, prefix-LM, a sliding
        window); the run is computed as a sequence starting at its first key. A row of any other
        form (or whose heads differ) gives NaN in the output, or a ValueError when the mask is
        known at trace time.
      window: a Python int >= 1 (causal only): a sliding window, each query at memory row ``p``
        sees at most the keys at rows ``p - window + 1 .. p`` (Mistral, Gemma), with every other
        limit above; a row is computed from its first visible key, so decode against a long cache
        gives the windowed prefill's bits.

    Returns ``[B, T, N, D]`` in q's dtype. A query that sees no key gets zeros. Differentiable in
    q, k and v to any order, forward and reverse (docs/derivatives.md): ``jax.grad`` runs the
    backward kernel; the first-order tangent (``jax.jvp``, ``jax.linearize``, ``jax.jacfwd``)
    materializes the probabilities in float32 for one block of query positions at a time, at
    most 256 MiB a block (memory O(B N T_block S)), with the bits of one block; second
    derivatives (``jax.hessian``, grad of grad, reverse mode over a tangent) materialize the
    T x S probabilities per head (memory O(B N T S)). Both keep the rows' invariance (jaxdet.matmul
    and jaxdet.sum for every reduction).

    Raises TypeError for unsupported or mixed dtypes and non-integer positions, ValueError for
    shapes that do not fit together (naming them).
    """
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a Python bool, got {type(causal).__name__}")
    dtypes = [float_dtype_of(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    if len(set(dtypes)) != 1:
        raise TypeError(
            f"q, k and v must have the same dtype, got {dtypes[0].name}, {dtypes[1].name} and {dtypes[2].name}"
        )
    ranks = (len(q.shape), len(k.shape), len(v.shape))
    if ranks not in ((4, 4, 4), (3, 3, 3)):
        raise ValueError(
            "q, k and v must be [B, T, N, D], [B, S, K, D], [B, S, K, D] (or all rank 3 without B), got "
            f"q{list(q.shape)}, k{list(k.shape)}, v{list(v.shape)}"
        )
    if ranks[0] == 3:
        unbatched = lambda x: None if x is None else jnp.asarray(x)[None]  # noqa: E731
        kv1 = None if kv_lengths is None else jnp.reshape(jnp.asarray(kv_lengths), (1,))
        out = attention(
            q[None],
            k[None],
            v[None],
            causal=causal,
            scale=scale,
            q_positions=unbatched(q_positions),
            kv_lengths=kv1,
            segment_ids=unbatched(segment_ids),
            mask=mask,
            window=window,
        )
        return out[0]
    B, T, N, D = q.shape
    S, K = k.shape[1], k.shape[2]
    if tuple(k.shape) != tuple(v.shape) or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k and v must both be [B={B}, S, K, D={D}] for q{list(q.shape)}, got k{list(k.shape)}, v{list(v.shape)}"
        )
    if K == 0 or N % K:
        raise ValueError(f"the number of KV heads ({K}) must divide the number of query heads ({N})")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dimension D must be 32 to 256 in steps of 16 (SUPPORTED_HEAD_DIMS), got {D}")
    # Symbolic dims (jax.export.symbolic_shape) are checked where the exported function is called.
    if any(isinstance(n, int) and n >= 2**31 - 1 for n in (T, S)):
        raise ValueError(f"sequence lengths must be < 2**31 - 1, got T={T}, S={S}")
    scale = 1.0 / math.sqrt(D) if scale is None else check_static_float(scale, "scale")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if window is not None:
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) or window < 1:
            raise TypeError(
                f"window must be a Python int >= 1 (the keys a query sees, itself included), got {window!r}"
            )
        if not causal:
            raise ValueError("window needs causal=True (a query sees its last `window` positions)")
    if mask is not None:
        if segment_ids is not None:
            raise ValueError(
                "segment_ids excludes mask (a packed sequence sees its own segment; AND them into one mask)"
            )
        _check_mask(mask, B, N, T, S)
    if segment_ids is not None:
        if q_positions is not None or kv_lengths is not None:
            raise ValueError("segment_ids excludes q_positions and kv_lengths (positions restart in each segment)")
        if T != S:
            raise ValueError(f"segment_ids needs self-attention shapes (T == S), got T={T}, S={S}")
        segment_ids = _check_int_array(segment_ids, "segment_ids", {(B, T)}, f"[B={B}, T={T}]")
    else:
        if q_positions is not None:
            q_positions = _check_int_array(q_positions, "q_positions", {(B, T), (T,)}, f"[B={B}, T={T}] or [T={T}]")
        elif causal and T != S:
            raise ValueError(
                f"causal attention with T={T} queries and S={S} keys needs q_positions (the position of each "
                "query in its sequence, e.g. the KV cache length before the step for decode)"
            )
        if kv_lengths is not None:
            kv_lengths = _check_int_array(kv_lengths, "kv_lengths", {(B,), ()}, f"[B={B}]")
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.size == 0:
        return jnp.zeros(q.shape, q.dtype)
    ok = None
    if segment_ids is not None:
        row_a, row_b = _segment_rows(segment_ids, causal)
        row_form = START_LIMIT
    elif mask is not None:
        row_a, row_b, ok = _rows_of_mask(mask, B, T, S, causal, q_positions, kv_lengths)
        row_form = START_LIMIT
    else:
        row_a, row_b, row_form = _position_rows(B, T, S, causal, q_positions, kv_lengths)
    if window is not None:
        row_a, row_b = _windowed(row_a, row_b, row_form, B, T, S, q_positions, segment_ids, int(window))
        row_form = START_LIMIT
    G = N // K
    Dk = next(d for d in KERNEL_HEAD_DIMS if d >= D)
    if Dk != D:
        q, k, v = (jnp.pad(x, [(0, 0)] * 3 + [(0, Dk - D)]) for x in (q, k, v))
    out = _attention5(q.reshape(B, T, K, G, Dk), k, v, row_a, row_b, scale, row_form)
    out = out.reshape(B, T, N, Dk)[..., :D]
    if ok is not None:
        out = jnp.where(ok[:, :, None, None], out, jnp.array(np.nan, out.dtype))
    return out


# The public function carries its constants (jaxdet.attention.KV_SPLIT, ...).
attention.KV_BLOCK, attention.KV_SPLIT = KV_BLOCK, KV_SPLIT
attention.SUPPORTED_HEAD_DIMS, attention.SUPPORTED_DTYPES = SUPPORTED_HEAD_DIMS, SUPPORTED_DTYPES
attention.KERNEL_HEAD_DIMS = KERNEL_HEAD_DIMS
