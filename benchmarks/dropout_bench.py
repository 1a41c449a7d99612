"""Dropout forward and backward vs a jax.random dropout and a copy-like op, in one run.

    python benchmarks/dropout_bench.py                  # 256Mi bfloat16 elements (64 x 4096 x 1024)
    python benchmarks/dropout_bench.py --shape 4x64x64 --reps 2   # tiny (runs on the CPU)
    python benchmarks/dropout_bench.py --sanitize       # small shapes, each kernel once (compute-sanitizer)

Prints a markdown table: median time, effective bandwidth (bytes read + written), and the
fraction of the copy-like op's bandwidth. A row that fails (out of memory) shows "OOM" or the
exception's class and the others still run (_timing.guard).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import failed, guard, header, timed  # noqa: E402

import jaxdet  # noqa: E402

RATE = 0.1


def jax_random_dropout(x, key):
    keep = jax.random.bernoulli(key, 1.0 - RATE, x.shape)
    return jnp.where(keep, x / (1.0 - RATE), jnp.zeros((), x.dtype))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sanitize", action="store_true", help="small shapes, run each kernel once")
    parser.add_argument("--reps", type=int, default=20, help="samples (the median is reported)")
    parser.add_argument("--inner", type=int, default=10, help="back-to-back calls per sample")
    parser.add_argument(
        "--shape",
        type=lambda s: tuple(int(v) for v in s.split("x")),
        default=(64, 4096, 1024),
        help="e.g. 64x4096x1024 (the default, 256Mi elements)",
    )
    args = parser.parse_args()
    shape = (3, 257, 33) if args.sanitize else args.shape
    dtype = jnp.bfloat16
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    g = jax.random.normal(jax.random.key(1), shape, jnp.float32).astype(dtype)
    key = jaxdet.random.key(0)
    jkey = jax.random.key(0)

    fwd = jax.jit(lambda x, k: jaxdet.dropout(x, k, RATE))
    bwd = jax.jit(lambda x, k, g: jax.vjp(lambda x: jaxdet.dropout(x, k, RATE), x)[1](g)[0])
    ref_fwd = jax.jit(jax_random_dropout)
    ref_bwd = jax.jit(lambda x, k, g: jax.vjp(lambda x: jax_random_dropout(x, k), x)[1](g)[0])
    copy_like = jax.jit(lambda x: x * jnp.asarray(1.5, dtype))
    if args.sanitize:
        for name, fn, a in [
            ("fwd", fwd, (x, key)),
            ("bwd", bwd, (x, key, g)),
            ("offset", jax.jit(lambda x, k: jaxdet.dropout(x, k, RATE, offset=3)), (x[1:], key)),
            ("bcast", jax.jit(lambda x, k: jaxdet.dropout(x, k, RATE, broadcast_dims=(1,))), (x, key)),
            (
                "vmap",
                jax.jit(jax.vmap(lambda x, k: jaxdet.dropout(x, k, RATE))),
                (x, jaxdet.random.split(key, shape[0])),
            ),
            (
                "philox",
                jax.jit(jaxdet.random.philox4x32_10),
                (jnp.arange(4 * 1001, dtype=jnp.uint32).reshape(1001, 4), key),
            ),
        ]:
            jax.block_until_ready(fn(*a))
            print(f"ran {name}")
        return

    print(
        header(
            f"{'x'.join(map(str, shape))} = {x.size / 2**20:.4g}Mi {np.dtype(dtype).name} elements, rate {RATE}; "
            f"median of {args.reps} x {args.inner} calls"
        )
        + "\n",
        flush=True,
    )
    nbytes = 2 * x.size * x.dtype.itemsize  # read x (or g) once, write the output once
    bench = lambda fn, *a: guard(timed, fn, *a, reps=args.reps, inner=args.inner)
    rows = [
        ("copy-like `x * 1.5` (ceiling)", bench(copy_like, x)),
        ("jaxdet.dropout forward", bench(fwd, x, key)),
        ("jaxdet.dropout backward (vjp)", bench(bwd, x, key, g)),
        ("jax.random.bernoulli + where, forward", bench(ref_fwd, x, jkey)),
        ("jax.random.bernoulli + where, backward (vjp)", bench(ref_bwd, x, jkey, g)),
    ]
    ceiling = nbytes / rows[0][1]
    print("| op | time (ms) | GB/s (read + write) | % of copy-like bandwidth |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        if failed(seconds):
            print(f"| {name} | {seconds} | - | - |")
            continue
        bw = nbytes / seconds
        share = "-" if failed(ceiling) else f"{100 * bw / ceiling:.0f}%"
        print(f"| {name} | {seconds * 1e3:.3f} | {bw / 1e9:.0f} | {share} |")


if __name__ == "__main__":
    main()
