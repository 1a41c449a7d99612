"""Benchmark: jaxdet.sum vs jnp.sum on the big reductions of a training step, side by side.

    python benchmarks/reduce_bench.py                      # GPU: markdown table for benchmarks/RESULTS.md
    python benchmarks/reduce_bench.py --dtype float32
    python benchmarks/reduce_bench.py --sanitize           # every kernel path once, small (compute-sanitizer)
    python benchmarks/reduce_bench.py --allow-cpu --small  # smoke-test the script without a GPU

Cases (x, axis): [8192, 2048] over the tokens (a bias gradient: B > 1, one chunk) and over the
features (row sums: B == 1); [8, 128256] over the vocabulary (few rows, 16 chunks); [65536, 4096]
over the tokens (8 chunks); [16384, 1024] over everything (one output, 2048 chunks). Each is timed
with the result in x's dtype and in float32 (jnp.sum(x, axis, dtype=...)). ratio = jnp time /
jaxdet time. Bandwidth: the bytes of x read per second of jaxdet's time, and its fraction of the
copy bandwidth measured in the same run (`x * 1.5`, float32, 1 GiB). Rule-bound floor: every
output's chunk is one chain of up to 8192 dependent float32 adds (about 4 cycles each), so a case
with few outputs per chunk cannot beat ~8192 x 4 cycles however fast the memory is
(docs/reduce.md, "Cost").
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _rowops_timing as rt  # noqa: E402
from _timing import failed, guard  # noqa: E402

import jaxdet  # noqa: E402

C = jaxdet.sum.CHUNK_TOKENS
CASES = [((8192, 2048), 0), ((8192, 2048), 1), ((8, 128256), 1), ((65536, 4096), 0), ((16384, 1024), None)]
SMALL_CASES = [((1024, 256), 0), ((1024, 256), 1), ((4, 3 * C + 5), 1), ((3 * C, 64), 0), ((512, 128), None)]


def inputs(shape, dtype, device):
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    return jax.device_put(jnp.asarray(x).astype(dtype), device)


def sanitize(device):
    """Every kernel path once: rows and columns, one chunk and several (the tree's kernel), 16-byte,
    4-byte and element copies, results in x's dtype and in float32."""
    shapes = [
        ((300, 64), 0),  # columns, 16-byte pieces
        ((3 * C + 5, 40), 0),  # columns, several chunks, partial tiles
        ((50, 34), 0),  # columns, 4-byte pieces (16-bit)
        ((70, 33), 0),  # columns, element copies
        ((2, 40, 5), 1),  # a small B > 1
        ((200, 1024), 1),  # rows, 16-byte pieces
        ((9, 2 * C + 2), 1),  # rows, several chunks, 4-byte pieces (16-bit)
        ((33, 1027), 1),  # rows, element copies
        ((5 * C + 17,), 0),  # one output, many chunks
        ((4, 0, 3), 1),  # nothing to add
    ]
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for shape, axis in shapes:
            x = inputs(shape, dtype, device)
            for out in (dtype, jnp.float32):
                jax.block_until_ready(jaxdet.sum(x, axis, dtype=out))
    print("sanitize: every reduce kernel path ran once")


def benchmark(args, device, dtype):
    bw = rt.print_header(dtype.name, args, device)
    rt.print_table_header(["x", "axis", "out"], "jnp")
    for shape, axis in SMALL_CASES if args.small else CASES:
        x = guard(inputs, shape, dtype, device)
        for out in (dtype, jnp.dtype(jnp.float32)) if dtype != jnp.float32 else (dtype,):
            base = (jax.jit(lambda x, axis=axis, out=out: jnp.sum(x, axis, dtype=out)), (x,))
            det = (jax.jit(lambda x, axis=axis, out=out: jaxdet.sum(x, axis, dtype=out)), (x,))
            if failed(x):
                base = det = x
            moved = rt.nbytes((shape, dtype))
            rt.print_timed_row([f"{list(shape)}", axis, out.name], base, det, moved, bw, args)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    rt.main(p, "bfloat16", sanitize, benchmark)


if __name__ == "__main__":
    main()
