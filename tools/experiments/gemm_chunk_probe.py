"""GPU probe: the chunked jaxdet_gemm target (K cut into chunks whose float32 partials meet by the
canonical tree) against its definition, and its time at several chunk sizes. The jnp column is XLA's
einsum of the same products in one program, which XLA may merge into one wider product: read it as
a reference only and compare jaxdet's columns with each other.

    python tools/experiments/gemm_chunk_probe.py bits            # default kernels (Hopper: one launch)
    JAXDET_TESTING=gemm_tile=64x128 python ... bits              # chunk by chunk (ping-pong tile)
    JAXDET_TESTING=gemm=sm80 python ... bits                     # the sm_80 kernels, chunk by chunk
    python tools/experiments/gemm_chunk_probe.py time [--chunks 2048,4096,8192]

Calls the FFI target directly (its `chunk` attribute and the workspace result), so it needs only
the CUDA handler. The definition: each chunk's float32 product alone (the same target with a chunk
larger than its K), combined in NumPy by the canonical tree in float32, cast once (RNE).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet  # noqa: F401  (registers the targets)

BIG = 1 << 40


def workspace_bytes(L, M, N, K, chunk):
    n = -(-K // chunk)
    if n <= 1:
        return 1
    return n * L * (M + 127) * (N + 255) * 4 + n * L * (-(-M // 16)) * (-(-N // 16)) * 4 + 1024


def gemm(a, b, tb, out_dtype, chunk):
    L, M, K = a.shape
    N = b.shape[1] if tb else b.shape[2]
    out = jax.ShapeDtypeStruct((L, M, N), out_dtype)
    ws = jax.ShapeDtypeStruct((workspace_bytes(L, M, N, K, chunk),), jnp.uint8)
    r, _ = jax.ffi.ffi_call("jaxdet_gemm", (out, ws))(
        a, b, transpose_a=False, transpose_b=bool(tb), chunk=np.int64(chunk)
    )
    return r


def tree(parts):
    stack = []
    for i, p in enumerate(parts):
        v = p
        bits = i
        while bits & 1:
            v = stack.pop() + v
            bits >>= 1
        stack.append(v)
    v = stack.pop()
    while stack:
        v = stack.pop() + v
    return v


def definition(a, b, tb, out_dtype, chunk):
    K = a.shape[2]
    parts = []
    for k0 in range(0, K, chunk):
        ak = a[:, :, k0 : k0 + chunk]
        bk = b[:, :, k0 : k0 + chunk] if tb else b[:, k0 : k0 + chunk, :]
        parts.append(np.asarray(gemm(ak, bk, tb, jnp.float32, BIG)))
    return jnp.asarray(tree(parts)).astype(out_dtype)


def bits_check():
    rng = np.random.default_rng(0)
    cases = [  # (L, Lb, M, K, N, chunk)
        (1, 1, 1, 14336, 4096, 4096),
        (1, 1, 16, 14336, 4096, 2048),
        (1, 1, 200, 4104, 1000, 256),
        (1, 1, 300, 1000, 1000, 256),
        (1, 1, 2048, 1000, 4096, 256),  # enough tiles: each CTA walks its tiles' chunks
        (1, 1, 1536, 4096, 3072, 512),
        (3, 3, 17, 264, 136, 128),
        (2, 1, 33, 520, 8, 128),
        (1, 1, 64, 128256 // 8, 512, 1024),
    ]
    bad = 0
    for L, Lb, M, K, N, chunk in cases:
        for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
            for tb in (False, True):
                for odt in {dt, jnp.float32}:
                    a = jnp.asarray(rng.standard_normal((L, M, K)), dt)
                    b = jnp.asarray(rng.standard_normal((Lb, N, K) if tb else (Lb, K, N)), dt)
                    got = np.asarray(gemm(a, b, tb, odt, chunk))
                    want = np.asarray(definition(a, b, tb, odt, chunk))
                    one = np.asarray(gemm(a, b, tb, odt, BIG))
                    u = np.uint16 if got.dtype.itemsize == 2 else np.uint32
                    diff = int(np.sum(got.view(u) != want.view(u)))
                    vs_one = int(np.sum(got.view(u) != one.view(u)))
                    name = f"L={L} M={M} K={K} N={N} chunk={chunk} {np.dtype(dt).name} tb={tb} out={np.dtype(odt).name}"
                    print(
                        f"{'OK ' if diff == 0 else 'BAD'} {name}: {diff} differ from the definition "
                        f"({vs_one} from one fold)",
                        flush=True,
                    )
                    bad += diff != 0
    print("BITS", "OK" if bad == 0 else f"FAILED {bad}")
    return bad == 0


def timed(fn, args, reps=15, inner=5):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            r = fn(*args)
        jax.block_until_ready(r)
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts)


def time_check(chunks, ms):
    rng = np.random.default_rng(1)
    # (op, K, N): fwd a[M,K] @ b[K,N]; dA dc[M,K'] @ b[N,K']^T (K' is the layer's output width)
    layers = [
        ("fwd", 14336, 4096),
        ("dA", 14336, 4096),
        ("dA", 128256, 4096),
        ("fwd", 4096, 4096),
        ("dA", 4096, 14336 // 4 * 4),
    ]
    calls = 8
    print("| op | K | N | M | jnp us | one fold | " + " | ".join(f"C={c}" for c in chunks) + " |")
    for op, K, N in layers:
        tb = op == "dA"
        b = jnp.asarray(rng.standard_normal((1, N, K) if tb else (1, K, N)) / 64, jnp.bfloat16)
        for M in ms:
            a = [jnp.asarray(rng.standard_normal((1, M, K)), jnp.bfloat16) for _ in range(calls)]

            def run(chunk):
                return jax.jit(lambda xs, b: [gemm(x, b, tb, jnp.bfloat16, chunk) for x in xs])

            ref = jax.jit(lambda xs, b: [jnp.einsum("lmk,lnk->lmn" if tb else "lmk,lkn->lmn", x, b) for x in xs])
            t_ref = timed(ref, (a, b)) / calls
            cells = [t_ref, timed(run(BIG), (a, b)) / calls] + [timed(run(c), (a, b)) / calls for c in chunks]
            ratios = " | ".join(f"{t_ref / t:.3f}" for t in cells[1:])
            print(f"| {op} | {K} | {N} | {M} | {t_ref * 1e6:.1f} | {ratios} |", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["bits", "time"])
    p.add_argument("--chunks", default="2048,4096,8192")
    p.add_argument("--ms", default="1,16,64,128,256,1024,4096")
    args = p.parse_args()
    print(jax.devices()[0].device_kind, flush=True)
    if args.what == "bits":
        sys.exit(0 if bits_check() else 1)
    time_check([int(c) for c in args.chunks.split(",")], [int(m) for m in args.ms.split(",")])


if __name__ == "__main__":
    main()
