"""Batch-invariant matrix multiplication with a deterministic, chunk-contracted weight gradient.

The contracts (docs/matmul.md, proven by tests/test_matmul.py):

* Row invariance. The bits of an output row of ``matmul(a, b)`` depend only on that row of ``a``
  and on ``b``: not on M, the row's position, the other rows, padding, batch dims, vmap or jit.
  Each output element is one float32 accumulator reduced over K in a fixed ascending order, with
  operations that depend on (dtype, layout, device) only (on the GPU the output tile may depend on
  M, never what a tile computes: docs/matmul_cuda.md, "M buckets"). The same holds for
  ``dA = dC . B^T`` in the backward pass (B is read transposed in place).
* dB chunk contract. ``dB = A^T . dC`` reduces over tokens (the rows of ``a``, all batch dims
  folded in). It is computed as a fixed sequence of chunk GEMMs of ``WGRAD_CHUNK_TOKENS`` tokens
  each, every chunk starting from 0 and adding its float32 partial into the running float32
  accumulator once (D = C + partial); a call without an accumulator starts it from chunk 0's partial. ``matmul_weight_grad(a, dc, acc)`` exposes that
  accumulation, so micro-batches whose token counts are multiples of ``WGRAD_CHUNK_TOKENS``
  reproduce the full-batch dB bitwise. Appending zero rows leaves dB unchanged.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet import _ffi

__all__ = ["matmul", "matmul_weight_grad", "WGRAD_CHUNK_TOKENS", "SUPPORTED_DTYPES"]

# Tokens per chunk GEMM of the weight gradient (the same on CPU and GPU). Micro-batches whose token
# counts are multiples of this reproduce the full-batch dB bitwise (see matmul_weight_grad).
WGRAD_CHUNK_TOKENS = 8192

SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_F32 = np.dtype(jnp.float32)


# ---- Primitive 1: jaxdet_gemm. a [L, M, K] (or [L, K, M] with transpose_a), b [Lb, K, N] (or
# [Lb, N, K] with transpose_b), Lb in {1, L}; out [L, M, N] of dtype out_dtype. ----

def _gemm_dims(a_shape, b_shape, transpose_a, transpose_b):
    L = a_shape[0]
    M, K = (a_shape[2], a_shape[1]) if transpose_a else (a_shape[1], a_shape[2])
    N = b_shape[1] if transpose_b else b_shape[2]
    return L, M, K, N


def _gemm_abstract_eval(a, b, *, transpose_a, transpose_b, out_dtype):
    L, M, _, N = _gemm_dims(a.shape, b.shape, transpose_a, transpose_b)
    return jax.core.ShapedArray((L, M, N), out_dtype)


def _gemm_batch(args, dims, *, transpose_a, transpose_b, out_dtype):
    a, b = args
    a_dim, b_dim = dims
    params = dict(transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype)
    if _ffi.not_mapped(b_dim) and not transpose_a:
        # Shared b: the vmapped axis of a folds into M (rows are independent, so the bits of every
        # row are those of the per-example call).
        a = jnp.moveaxis(a, a_dim, 1)  # [L, B, M, K]
        L, B, M, K = a.shape
        out = gemm_p.bind(a.reshape(L, B * M, K), b, **params)
        return out.reshape(L, B, M, out.shape[-1]), 1
    # Otherwise the vmapped axis joins L: a batched GEMM.
    size = a.shape[a_dim] if not _ffi.not_mapped(a_dim) else b.shape[b_dim]
    a = jnp.broadcast_to(a, (size,) + a.shape) if _ffi.not_mapped(a_dim) else jnp.moveaxis(a, a_dim, 0)
    L = a.shape[1]
    if _ffi.not_mapped(b_dim):
        b = jnp.broadcast_to(b, (size, L) + b.shape[1:])  # b [Lb, ., .], Lb in {1, L}
    else:
        b = jnp.moveaxis(b, b_dim, 0)
        if b.shape[1] != L:  # Lb == 1 < L: give every (example, l) its own b
            b = jnp.broadcast_to(b, (size, L) + b.shape[2:])
    out = gemm_p.bind(a.reshape((size * L,) + a.shape[2:]), b.reshape((size * L,) + b.shape[2:]), **params)
    return out.reshape((size, L) + out.shape[1:]), 0


gemm_p = _ffi.define_primitive(
    "jaxdet_gemm",
    _gemm_abstract_eval,
    attributes=lambda transpose_a, transpose_b, out_dtype: dict(
        transpose_a=bool(transpose_a), transpose_b=bool(transpose_b)
    ),
    batching_rule=_gemm_batch,
)


# ---- Primitive 2: jaxdet_gemm_wgrad. acc f32 [L, K, N] (aliased to the result), a [L, T, K],
# dc [L, T, N]: for each chunk of chunk_tokens tokens in order, acc = acc + a[chunk]^T . dc[chunk]. ----

def _wgrad_abstract_eval(acc, a, dc, *, chunk_tokens):
    return jax.core.ShapedArray(acc.shape, acc.dtype)


def _fold_mapped_axis(args, dims):
    """Moves the vmapped axis of every operand to the front and folds it into L: [size * L, ...]."""
    size = next(x.shape[d] for x, d in zip(args, dims) if not _ffi.not_mapped(d))
    moved = [
        jnp.broadcast_to(x, (size,) + x.shape) if _ffi.not_mapped(d) else jnp.moveaxis(x, d, 0)
        for x, d in zip(args, dims)
    ]
    L = moved[0].shape[1]
    return size, L, [x.reshape((size * L,) + x.shape[2:]) for x in moved]


def _wgrad_batch(args, dims, *, chunk_tokens):
    size, L, flat = _fold_mapped_axis(args, dims)
    out = wgrad_p.bind(*flat, chunk_tokens=chunk_tokens)
    return out.reshape((size, L) + out.shape[1:]), 0


wgrad_p = _ffi.define_primitive(
    "jaxdet_gemm_wgrad",
    _wgrad_abstract_eval,
    attributes=lambda chunk_tokens: dict(chunk_tokens=np.int64(chunk_tokens)),
    batching_rule=_wgrad_batch,
    operand_output_aliases={0: 0},
)


# ---- Primitive 3: jaxdet_gemm_wgrad_init. a [L, T, K], dc [L, T, N] -> (dB [L, K, N] of out_dtype,
# workspace f32): the same chunk sequence with no accumulator to start from: chunk 0's partial is
# written as it is (no zero fill, no accumulator read), every later chunk adds. A bfloat16/float16
# dB is the float32 result cast once (RNE); on the GPU the earlier chunks accumulate in the float32
# workspace and the last chunk's epilogue adds and casts, so no float32 dB is written and cast
# afterwards. The workspace is [L, K, N] only when a half dB spans several chunks, else [L, 0, 0]. ----

def _wgrad_init_shapes(L, T, K, N, chunk_tokens, out_dtype):
    needs_workspace = np.dtype(out_dtype) != _F32 and T > chunk_tokens
    return (L, K, N), (L, K, N) if needs_workspace else (L, 0, 0)


def _wgrad_init_abstract_eval(a, dc, *, chunk_tokens, out_dtype):
    L, T, K = a.shape
    out_shape, ws_shape = _wgrad_init_shapes(L, T, K, dc.shape[2], chunk_tokens, out_dtype)
    return (jax.core.ShapedArray(out_shape, out_dtype), jax.core.ShapedArray(ws_shape, jnp.float32))


def _wgrad_init_batch(args, dims, *, chunk_tokens, out_dtype):
    size, L, flat = _fold_mapped_axis(args, dims)
    outs = wgrad_init_p.bind(*flat, chunk_tokens=chunk_tokens, out_dtype=out_dtype)
    return [o.reshape((size, L) + o.shape[1:]) for o in outs], [0, 0]


wgrad_init_p = _ffi.define_primitive(
    "jaxdet_gemm_wgrad_init",
    _wgrad_init_abstract_eval,
    attributes=lambda chunk_tokens, out_dtype: dict(chunk_tokens=np.int64(chunk_tokens)),
    batching_rule=_wgrad_init_batch,
    multiple_results=True,
)


# ---- The differentiable 3-D core: a3 [L, M, K] @ b3 [Lb, K, N], Lb in {1, L} (1 only when L == 1). ----

# bfloat16/float16 rows must be 16-byte aligned for the GPU kernels' TMA loads and stores, so K and
# N are zero-padded to multiples of 8 there. This is exact: padding K adds 0 * 0 products after the
# real ones (what TMA's out-of-bounds fill feeds the last K tile anyway), padding N adds output
# columns that are sliced off. It depends on (dtype, K, N) only, never on M.
_ALIGN = 8


def _padded(n, dtype):
    return -(-n // _ALIGN) * _ALIGN if np.dtype(dtype).itemsize == 2 else n


def _pad_last2(x, rows, cols):
    if x.shape[-2:] == (rows, cols):
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rows - x.shape[-2]), (0, cols - x.shape[-1])])


def _gemm(a3, b3, out_dtype, transpose_b=False):
    """op(a3) @ op(b3): a3 [L, M, K]; b3 [Lb, K, N] (or [Lb, N, K] with transpose_b)."""
    M, K = a3.shape[-2:]
    N = b3.shape[-2] if transpose_b else b3.shape[-1]
    Kp, Np = _padded(K, a3.dtype), _padded(N, a3.dtype)
    a3 = _pad_last2(a3, M, Kp)
    b3 = _pad_last2(b3, Np, Kp) if transpose_b else _pad_last2(b3, Kp, Np)
    out = gemm_p.bind(a3, b3, transpose_a=False, transpose_b=transpose_b, out_dtype=np.dtype(out_dtype))
    return out if Np == N else out[..., :N]


def _wgrad(acc3, a3, dc3, out_dtype=_F32):
    """acc3 [L, K, N] + a3ᵀ [L, T, K] . dc3 [L, T, N], chunk by chunk, in float32.

    acc3 None: from chunk 0's partial, and the result is cast once to `out_dtype` (float32 or the
    inputs' dtype); otherwise the result is the float32 accumulator.
    """
    T, K = a3.shape[-2:]
    N = dc3.shape[-1]
    Kp, Np = _padded(K, a3.dtype), _padded(N, a3.dtype)
    a3, dc3 = _pad_last2(a3, T, Kp), _pad_last2(dc3, T, Np)
    if acc3 is None:
        out, _ = wgrad_init_p.bind(a3, dc3, chunk_tokens=WGRAD_CHUNK_TOKENS, out_dtype=np.dtype(out_dtype))
    else:
        out = wgrad_p.bind(_pad_last2(acc3, Kp, Np), a3, dc3, chunk_tokens=WGRAD_CHUNK_TOKENS)
    return out if (Kp, Np) == (K, N) else out[..., :K, :N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul3(a3, b3, out_dtype):
    return _gemm(a3, b3, out_dtype)


def _matmul3_fwd(a3, b3, out_dtype):
    return _gemm(a3, b3, out_dtype), (a3, b3)


def _matmul3_bwd(out_dtype, res, g):
    a3, b3 = res
    # The cotangent enters the kernels in the input dtype (a float32 cotangent of a bf16/f16 matmul
    # with preferred_element_type=float32 is rounded once to the input dtype).
    g = g.astype(a3.dtype)
    da = _gemm(g, b3, a3.dtype, transpose_b=True)  # dC . B^T, B read transposed in place
    db = _wgrad(None, a3, g, out_dtype=b3.dtype)  # the float32 chunk sequence, cast once
    return da, db


_matmul3.defvjp(_matmul3_fwd, _matmul3_bwd)


# ---- Checks shared by the public functions. ----

def _check_array(x, name):
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
    dtype = np.dtype(x.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {dtype.name}")
    return dtype


def _check_same_dtype(a_dtype, b_dtype, names):
    if a_dtype != b_dtype:
        raise TypeError(
            f"{names[0]} and {names[1]} must have the same dtype, got {a_dtype.name} and {b_dtype.name}; "
            "cast one of them explicitly (jaxdet.matmul never promotes)"
        )


def _out_dtype(dtype, preferred_element_type):
    if preferred_element_type is None:
        return dtype
    try:
        pref = np.dtype(preferred_element_type)
    except TypeError:
        raise TypeError(f"preferred_element_type must be a dtype or None, got {preferred_element_type!r}") from None
    if pref == dtype or pref == _F32:
        return pref
    raise TypeError(
        f"preferred_element_type must be None, the input dtype ({dtype.name}) or float32, got {pref.name}"
    )


def matmul(a, b, *, preferred_element_type=None):
    """Batch-invariant ``a @ b``.

    Args:
      a: ``[..., M, K]`` float32, bfloat16 or float16.
      b: ``[K, N]`` (shared weights: a's batch dims fold into M) or ``[..., K, N]`` (batched,
        broadcast against a's batch dims as in ``jnp.matmul``). Same dtype as ``a``.
      preferred_element_type: None (output in the input dtype) or ``jnp.float32`` (float32 output
        for bf16/f16 inputs). Accumulation is always float32; float32 inputs use true float32
        arithmetic, never TF32.

    Returns ``[..., M, N]``. Row ``i`` of the result is bitwise a function of row ``i`` of ``a`` and
    of ``b`` only. Reverse-mode differentiable (``jax.custom_vjp``): dA has the same row
    invariance; dB follows the chunk contract of ``matmul_weight_grad``.

    Raises TypeError for unsupported or mixed dtypes and a bad ``preferred_element_type``,
    ValueError for ranks below 2 and for mismatched K (naming both shapes).
    """
    a_dtype = _check_array(a, "a")
    b_dtype = _check_array(b, "b")
    _check_same_dtype(a_dtype, b_dtype, ("a", "b"))
    out_dtype = _out_dtype(a_dtype, preferred_element_type)
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ValueError(f"a and b must have rank >= 2 (a[..., M, K], b[..., K, N]), got a{list(a_shape)} b{list(b_shape)}")
    M, K = a_shape[-2:]
    Kb, N = b_shape[-2:]
    if K != Kb:
        raise ValueError(
            f"matmul contraction mismatch: a{list(a_shape)} has K={K} but b{list(b_shape)} has K={Kb}"
        )
    try:
        batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    except ValueError:
        raise ValueError(
            f"batch dimensions of a{list(a_shape)} and b{list(b_shape)} do not broadcast"
        ) from None
    out_shape = batch + (M, N)
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    if math.prod(out_shape) == 0 or K == 0:
        return jnp.zeros(out_shape, out_dtype)
    if all(d == 1 for d in b_shape[:-2]):
        # Shared weights: every row of every batch element is one row of a single GEMM.
        a3 = jnp.broadcast_to(a, batch + (M, K)).reshape(1, -1, K)
        out = _matmul3(a3, b.reshape(1, K, N), out_dtype)
        return out.reshape(out_shape)
    L = math.prod(batch)
    a3 = jnp.broadcast_to(a, batch + (M, K)).reshape(L, M, K)
    b3 = jnp.broadcast_to(b, batch + (K, N)).reshape(L, K, N)
    return _matmul3(a3, b3, out_dtype).reshape(out_shape)


def matmul_weight_grad(a, dc, acc=None):
    """``acc + a^T . dc`` over all tokens, with dB's chunk contract: the float32 accumulator.

    Args:
      a: ``[..., K]`` activations (all leading dims are tokens, flattened row-major).
      dc: ``[..., N]`` output cotangents with the same leading dims, in a's dtype.
      acc: float32 ``[K, N]`` running accumulator, or None to start from the first chunk's partial.

    Returns the updated float32 ``[K, N]`` accumulator. The tokens are reduced as a fixed sequence
    of chunk GEMMs of ``WGRAD_CHUNK_TOKENS`` tokens (the last may be shorter), in order; each chunk
    sums its tokens in ascending order in float32 from 0 and adds the partial to ``acc`` once.

    This is exactly how ``jax.grad`` of ``matmul(x, w)`` computes dW (then cast to w's dtype), so
    for micro-batches ``x1, x2, ...`` whose token counts are all multiples of WGRAD_CHUNK_TOKENS
    (except possibly the last)::

        acc = None
        for x_i, dc_i in micro_batches:
            acc = matmul_weight_grad(x_i, dc_i, acc)
        # acc.astype(w.dtype) is bitwise the dW of the whole batch in one matmul

    Appending zero rows (padding tokens) to ``a`` and ``dc`` does not change the result.
    """
    a_dtype = _check_array(a, "a")
    dc_dtype = _check_array(dc, "dc")
    _check_same_dtype(a_dtype, dc_dtype, ("a", "dc"))
    a_shape, dc_shape = tuple(a.shape), tuple(dc.shape)
    if len(a_shape) < 1 or len(dc_shape) < 1 or a_shape[:-1] != dc_shape[:-1]:
        raise ValueError(
            f"a[..., K] and dc[..., N] must have the same token dims, got a{list(a_shape)} dc{list(dc_shape)}"
        )
    K, N = a_shape[-1], dc_shape[-1]
    if acc is not None:
        if not (hasattr(acc, "dtype") and hasattr(acc, "shape")) or np.dtype(acc.dtype) != _F32:
            raise TypeError(f"acc must be a float32 array, got {getattr(acc, 'dtype', type(acc).__name__)}")
        if tuple(acc.shape) != (K, N):
            raise ValueError(f"acc must have shape [K, N] = {[K, N]} for a{list(a_shape)} dc{list(dc_shape)}, got {list(acc.shape)}")
        acc = jnp.asarray(acc)
    T = math.prod(a_shape[:-1])
    if T == 0 or K == 0 or N == 0:
        return jnp.zeros((K, N), jnp.float32) if acc is None else acc
    a3 = jnp.asarray(a).reshape(1, T, K)
    dc3 = jnp.asarray(dc).reshape(1, T, N)
    return _wgrad(None if acc is None else acc.reshape(1, K, N), a3, dc3).reshape(K, N)


# `jaxdet.matmul` is the function (the package exports it), so the chunk size is reachable from it too.
matmul.WGRAD_CHUNK_TOKENS = WGRAD_CHUNK_TOKENS
