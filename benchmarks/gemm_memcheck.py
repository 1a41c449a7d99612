"""Small calls of every GEMM kernel family, for `compute-sanitizer --tool memcheck`.

Edge tiles in every dimension (M, N, K not multiples of the tiles), M <= 64 (one tile whose second
consumer warpgroup holds no row), batches, b broadcast and the chunked weight gradient (accumulating,
and from nothing in every result dtype), and every tile of the M-bucketed kernel sets (a row count
for which the bucket rule picks it, with partial edge tiles). Prints the relative errors; the
sanitizer reports memory errors. Run it again with JAXDET_TESTING=gemm=sm80 for the sm_80 kernels.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_ffi import gemm, wgrad, wgrad_init

from jaxdet import _native


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def check_wgrad(dt, kdim, seed):
    """The chunked weight gradient into an accumulator, and from nothing in every result dtype (one
    chunk, and several: the last chunk's epilogue reads the float32 workspace and writes the half
    result). dB has kdim rows. Returns the worst relative error against float64."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    acc = jax.random.normal(k1, (2, kdim, 264), jnp.float32)
    a = jax.random.normal(k2, (2, 300, kdim)).astype(dt)
    dc = jax.random.normal(k3, (2, 300, 264)).astype(dt)
    r = wgrad(acc, a, dc, 128)
    ref = f64(acc) + np.einsum("ltk,ltn->lkn", f64(a), f64(dc))
    worst = np.linalg.norm(f64(r) - ref) / np.linalg.norm(ref)
    for out_dt in (dt, jnp.float32) if dt != jnp.float32 else (dt,):
        for T in (100, 300):
            r = wgrad_init(a[:, :T], dc[:, :T], 128, out_dt)
            ref = np.einsum("ltk,ltn->lkn", f64(a[:, :T]), f64(dc[:, :T]))
            worst = max(worst, np.linalg.norm(f64(r) - ref) / np.linalg.norm(ref))
    return worst


key = jax.random.PRNGKey(0)
worst = 0.0
for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
    # every layout with M = 136 (two M tiles, the second partial), and M = 24 for the Hopper layouts
    # (b is shared, so the batch of 2 runs as one GEMM of 48 rows: one tile of <= 64 rows)
    cases = [(ta, tb, 136) for ta in (False, True) for tb in (False, True)]
    cases += [(False, False, 24), (False, True, 24)]
    for ta, tb, M in cases:
        for out in (dt, jnp.float32) if dt != jnp.float32 else (dt,):
            L, Lb, K, N = 2, 1, 200, 264
            key, k1, k2 = jax.random.split(key, 3)
            a = jax.random.normal(k1, (L, K, M) if ta else (L, M, K)).astype(dt)
            b = jax.random.normal(k2, (Lb, N, K) if tb else (Lb, K, N)).astype(dt)
            r = gemm(a, b, ta, tb, out)
            A = np.swapaxes(f64(a), 1, 2) if ta else f64(a)
            B = np.swapaxes(f64(b), 1, 2) if tb else f64(b)
            ref = A @ B
            e = np.linalg.norm(f64(r) - ref) / np.linalg.norm(ref)
            worst = max(worst, e)
    for kdim in (136, 40):  # dB's rows: two tiles, the second partial; and one tile of <= 64 rows
        worst = max(worst, check_wgrad(dt, kdim, seed=kdim))


def bucket_cases(dname, tb, n):
    """For every tile of the bucketed set: a row count (not a multiple of the tile's rows where the
    rule allows) for which the bucket rule picks that tile for n output columns."""
    tiles = [tuple(t) for t in _native.gemm_cuda_tiles(dname, False, tb, False)]
    picked = {}
    for m in range(1, 4097):
        t = tuple(_native.gemm_cuda_tile(dname, False, tb, False, m, n, 1))
        if t not in picked or picked[t] % t[0] == 0:
            picked[t] = m
    return [(t, picked[t]) for t in tiles if t in picked]


if hasattr(_native, "gemm_cuda_tiles"):
    covered = set()
    for dname, dt in (("bfloat16", jnp.bfloat16), ("float16", jnp.float16)):
        for tb, N in ((False, 4104), (True, 4104), (False, 14344), (True, 14344)):
            K = 200  # N = 4096 / 14336 + 8: a partial last column of every tile width
            for tile, M in bucket_cases(dname, tb, N):
                key, k1, k2 = jax.random.split(key, 3)
                a = jax.random.normal(k1, (1, M, K)).astype(dt)
                b = jax.random.normal(k2, (1, N, K) if tb else (1, K, N)).astype(dt)
                B = np.swapaxes(f64(b), 1, 2) if tb else f64(b)
                ref = f64(a) @ B
                for out in (dt, jnp.float32):  # (the float32-output sets lack 128x128: their own pick)
                    r = gemm(a, b, False, tb, out)
                    worst = max(worst, np.linalg.norm(f64(r) - ref) / np.linalg.norm(ref))
                covered.add(f"{tile[0]}x{tile[1]}@M={M}")
    print("bucket tiles covered:", " ".join(sorted(covered)), flush=True)
print(f"memcheck run done; worst relerr {worst:.2e}", flush=True)
