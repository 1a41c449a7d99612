"""Raw calls of the jaxdet_gemm / jaxdet_gemm_wgrad FFI targets (the interface the primitives bind),
for the kernel tests (tests/test_gemm_cuda_kernels.py) and benchmarks/matmul_bench.py (`--raw`
times them without jaxdet.matmul's wrapper; `--sanitize` runs every kernel family through them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import ffi  # noqa: F401  (registers the FFI targets)
from jaxdet._src.matmul.matmul import GEMM_CHUNK, gemm_cpu_workspace_bytes, gemm_workspace_bytes, wgrad_init_shapes


def gemm(a, b, transpose_a=False, transpose_b=False, out_dtype=None, chunk=GEMM_CHUNK):
    """out[L,M,N] = op(a) @ op(b) by the chunk rule with chunks of `chunk` elements of K;
    a [L,M,K] or [L,K,M]; b [Lb,K,N] or [Lb,N,K], Lb in {1, L}."""
    squeeze = a.ndim == 2
    if squeeze:
        a = a[None]
    if b.ndim == 2:
        b = b[None]
    L = a.shape[0]
    M, K = (a.shape[2], a.shape[1]) if transpose_a else (a.shape[1], a.shape[2])
    N = b.shape[1] if transpose_b else b.shape[2]
    out = jax.ShapeDtypeStruct((L, M, N), out_dtype or a.dtype)
    attrs = dict(transpose_a=bool(transpose_a), transpose_b=bool(transpose_b), chunk=np.int64(chunk))

    def call(workspace_bytes):
        # The handlers take one more result: their workspace (the primitive's cpu/cuda_workspace).
        workspace = jax.ShapeDtypeStruct((max(workspace_bytes(L, M, N, K, chunk), 1),), jnp.uint8)
        return lambda a, b: jax.ffi.ffi_call("jaxdet_gemm", (out, workspace))(a, b, **attrs)[0]

    on_cpu = call(gemm_cpu_workspace_bytes)
    on_cuda = call(gemm_workspace_bytes)

    r = jax.lax.platform_dependent(a, b, cpu=on_cpu, cuda=on_cuda)
    return r[0] if squeeze else r


def wgrad(acc, a, dc, chunk_tokens=2048):
    """acc[L,K,N] + sum over token chunks, in order, of a[chunk]^T dc[chunk] (f32; result aliases acc)."""
    squeeze = acc.ndim == 2
    if squeeze:
        acc, a, dc = acc[None], a[None], dc[None]
    r = jax.ffi.ffi_call(
        "jaxdet_gemm_wgrad", jax.ShapeDtypeStruct(acc.shape, jnp.float32), input_output_aliases={0: 0}
    )(acc, a, dc, chunk_tokens=np.int64(chunk_tokens))
    return r[0] if squeeze else r


def wgrad_init(a, dc, chunk_tokens, out_dtype):
    """The chunk sequence from nothing, result in out_dtype (f32, or a's dtype: cast once, RNE)."""
    L, T, K = a.shape
    # the result and workspace shapes the primitive declares (jaxdet/_src/matmul/matmul.py)
    out_shape, ws_shape = wgrad_init_shapes(L, T, K, dc.shape[2], chunk_tokens, out_dtype)
    out, _ = jax.ffi.ffi_call(
        "jaxdet_gemm_wgrad_init",
        (jax.ShapeDtypeStruct(out_shape, out_dtype), jax.ShapeDtypeStruct(ws_shape, jnp.float32)),
    )(a, dc, chunk_tokens=np.int64(chunk_tokens))
    return out
