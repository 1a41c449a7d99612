"""Batch-invariant matmul vs jnp.dot on the GPU: forward, dA and dB, bfloat16, side by side in one run.

    python benchmarks/matmul_bench.py [--ms 1,16,128,1024,4096,16384] [--shapes all|4096x4096,...]
                                      [--ops fwd,dA,dB] [--reps 20] [--raw] [--out results.md]
                                      [--chunk-tokens 8192]

Uses `jaxdet.matmul` (forward and its VJP) when it exists (and --raw is not given), else the raw
FFI targets: fwd = jaxdet_gemm(A, B); dA = jaxdet_gemm(dC, B, transpose_b=True);
dB = jaxdet_gemm_wgrad(acc=0 f32, A, dC, chunk_tokens=2048) (f32 result). The jnp baselines are
jnp.dot(A, B), jnp.dot(dC, B.T) and jnp.dot(A.T, dC) (bfloat16 out, what jax's gradient of jnp.dot
computes), or the VJP of jnp.dot when jaxdet.matmul is used.

Timing: jitted functions, warm-up, then the median over `--reps` timings of `--inner` back-to-back
calls each (block_until_ready at the end), the jnp and jaxdet repetitions alternating (so that a
clock or power drift during a long cell hits both sides alike); inputs rotate among several copies
when they are small enough, so that repeated calls do not run from L2. "bits" columns: how many bits-differing elements
of output row 0 between M=1 and M=4096 (jnp.dot vs jaxdet), per (K, N), forward.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gemm_ffi import gemm, wgrad  # noqa: E402

import jaxdet  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 128256)]
MS = [1, 16, 128, 1024, 4096, 16384]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--shapes", default="all")
    p.add_argument("--ops", default="fwd,dA,dB")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--raw", action="store_true")
    p.add_argument("--out", default="")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="measure dB with this WGRAD_CHUNK_TOKENS instead of the library's (an experiment: "
        "it changes dB's bits and its micro-batch granularity)",
    )
    return p.parse_args()


def timeit(fn, argsets, reps, inner, chain=False):
    """Median ms per call. chain: fn(state, *args) -> state (donated accumulators)."""
    if chain:
        state = argsets[0][0]
        for _ in range(2):
            state = fn(state, *argsets[0][1:])
        state.block_until_ready()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(inner):
                state = fn(state, *argsets[i % len(argsets)][1:])
            state.block_until_ready()
            times.append((time.perf_counter() - t0) / inner)
        return 1e3 * statistics.median(times)
    out = None
    for s in argsets:
        out = fn(*s)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(inner):
            out = fn(*argsets[i % len(argsets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return 1e3 * statistics.median(times)


def timeit_pair(fn_ref, fn_det, argsets, reps, inner):
    """Median ms per call of two functions on the same inputs, measured in alternating repetitions
    (and alternating which goes first), so that clock and power drifts during a long cell hit both
    alike."""
    fns = (fn_ref, fn_det)
    for fn in fns:
        out = None
        for s in argsets:
            out = fn(*s)
        jax.block_until_ready(out)
    times = ([], [])
    for rep in range(reps):
        for j in (0, 1) if rep % 2 == 0 else (1, 0):
            fn = fns[j]
            t0 = time.perf_counter()
            for i in range(inner):
                out = fn(*argsets[i % len(argsets)])
            jax.block_until_ready(out)
            times[j].append((time.perf_counter() - t0) / inner)
    return tuple(1e3 * statistics.median(t) for t in times)


def main():
    args = parse()
    ms = [int(x) for x in args.ms.split(",")]
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ops = args.ops.split(",")
    use_api = hasattr(jaxdet, "matmul") and not args.raw
    if args.chunk_tokens:
        # read when the dB function is traced, so set it before anything is jitted
        importlib.import_module("jaxdet.matmul").WGRAD_CHUNK_TOKENS = args.chunk_tokens
    chunk_tokens = importlib.import_module("jaxdet.matmul").WGRAD_CHUNK_TOKENS if use_api else 2048
    dt = jnp.bfloat16
    dev = jax.devices()[0]
    head = (
        f"# matmul benchmark: jaxdet vs jnp.dot, bfloat16\n\ndevice: {dev.device_kind}; jax {jax.__version__}; "
        f"{datetime.date.today()}; jaxdet via {'jaxdet.matmul' if use_api else 'raw FFI targets'}; "
        f"dB chunk_tokens {chunk_tokens}; "
        f"median of {args.reps} x {args.inner} back-to-back calls, jnp and jaxdet repetitions alternating\n"
    )
    print(head, flush=True)
    rows = []
    key = jax.random.PRNGKey(0)

    if use_api:
        mm = jax.jit(jaxdet.matmul)
        fwd_det = mm
        da_det = jax.jit(lambda a, b, dc: jax.vjp(lambda x: jaxdet.matmul(x, b), a)[1](dc)[0])
        db_det = jax.jit(lambda a, b, dc: jax.vjp(lambda y: jaxdet.matmul(a, y), b)[1](dc)[0])
        da_ref = jax.jit(lambda a, b, dc: jax.vjp(lambda x: jnp.dot(x, b), a)[1](dc)[0])
        db_ref = jax.jit(lambda a, b, dc: jax.vjp(lambda y: jnp.dot(a, y), b)[1](dc)[0])
    else:
        fwd_det = jax.jit(lambda a, b: gemm(a, b))
        da_det = jax.jit(lambda a, b, dc: gemm(dc, b, transpose_b=True))
        db_det_chain = jax.jit(lambda acc, a, dc: wgrad(acc, a, dc, 2048), donate_argnums=0)
        da_ref = jax.jit(lambda a, b, dc: jnp.dot(dc, b.T))
        db_ref = jax.jit(lambda a, b, dc: jnp.dot(a.T, dc))
    fwd_ref = jax.jit(jnp.dot)

    bits = {}
    for K, N in shapes:
        key, kb = jax.random.split(key)
        b = jax.random.normal(kb, (K, N), jnp.float32).astype(dt)
        nb = 3 if K * N * 2 < 200e6 else 1
        bs = [b] + [b + 0 for _ in range(nb - 1)]
        # Bits changed between M=1 and M=4096 for row 0 (forward).
        key, ka = jax.random.split(key)
        a4 = jax.random.normal(ka, (4096, K), jnp.float32).astype(dt)
        u = lambda x: np.asarray(x).view(np.uint16)  # noqa: E731
        bits[(K, N)] = (
            int(np.sum(u(fwd_ref(a4[:1], b)[0]) != u(fwd_ref(a4, b)[0]))),
            int(np.sum(u(fwd_det(a4[:1], b)[0]) != u(fwd_det(a4, b)[0]))),
        )
        del a4
        for M in ms:
            key, ka, kc = jax.random.split(key, 3)
            a = jax.random.normal(ka, (M, K), jnp.float32).astype(dt)
            dc = jax.random.normal(kc, (M, N), jnp.float32).astype(dt)
            na = 3 if (M * K + M * N) * 2 < 200e6 and nb > 1 else 1
            sets = [(a + 0 if i else a, bs[i % nb], dc + 0 if i else dc) for i in range(max(na, 1))]
            for op in ops:
                flops = 2.0 * M * K * N
                if op == "fwd":
                    ab = [(s[0], s[1]) for s in sets]
                    t_ref, t_det = timeit_pair(fwd_ref, fwd_det, ab, args.reps, args.inner)
                elif op == "dA":
                    t_ref, t_det = timeit_pair(da_ref, da_det, sets, args.reps, args.inner)
                elif use_api:
                    t_ref, t_det = timeit_pair(db_ref, db_det, sets, args.reps, args.inner)
                else:
                    t_ref = timeit(db_ref, sets, args.reps, args.inner)
                    acc = jnp.zeros((K, N), jnp.float32)
                    t_det = timeit(db_det_chain, [(acc, s[0], s[2]) for s in sets], args.reps, args.inner, chain=True)
                r = (op, K, N, M, t_ref, t_det, t_ref / t_det, flops / t_ref / 1e9, flops / t_det / 1e9)
                rows.append(r)
                print(
                    f"{op:3s} K={K:6d} N={N:6d} M={M:6d}  jnp {t_ref:9.4f} ms ({r[7]:6.0f} TF/s)  "
                    f"jaxdet {t_det:9.4f} ms ({r[8]:6.0f} TF/s)  ratio {r[6]:.3f}",
                    flush=True,
                )
            del sets, a, dc
        del bs, b

    lines = [
        head,
        "| op | K | N | M | jnp.dot ms | jaxdet ms | throughput ratio (jnp time / jaxdet time) | jnp TFLOP/s | jaxdet TFLOP/s |",  # noqa: E501
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.4f} | {r[5]:.4f} | {r[6]:.3f} | {r[7]:.0f} | {r[8]:.0f} |"
        )
    lines += [
        "",
        "Row 0 bits (elements of row 0 whose bits differ between M=1 and M=4096), forward:",
        "",
        "| K | N | jnp.dot | jaxdet |",
        "|---|---|---|---|",
    ]
    for (K, N), (bj, bd) in bits.items():
        lines.append(f"| {K} | {N} | {bj}/{N} | {bd}/{N} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
