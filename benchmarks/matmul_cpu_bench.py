"""CPU benchmark: jaxdet.matmul vs jnp.dot (XLA's CPU dot) on the same shapes.

    PYTHONPATH=<site> python benchmarks/matmul_cpu_bench.py [--reps 10]
    PYTHONPATH=<site> python benchmarks/matmul_cpu_bench.py --quick --reps 3   # float32 1024^3 only

Prints a table of median times and the ratio (jnp.dot time / jaxdet time, so >= 1 means jaxdet is
faster). The two are timed in alternating repetitions, so that load from other processes on a
shared machine falls on both alike. The acceptance figure is float32 1024^3: ratio >= 0.5. A
cell that fails shows "OOM" or the exception's class and the run goes on (_timing.guard).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import failed, guard, header, pair_or_each  # noqa: E402

import jaxdet  # noqa: E402
from jaxdet import _native  # noqa: E402

SHAPES = [  # (M, K, N)
    (1024, 1024, 1024),
    (2048, 2048, 2048),
    (1, 4096, 4096),
    (16, 4096, 4096),
    (128, 4096, 1024),
    (4096, 512, 512),
]


def _median_times(fns, args, reps):
    """Median seconds per call of each function, measured in alternating repetitions."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            ts.append(time.perf_counter() - t0)
    return [float(np.median(ts)) for ts in times]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=10, help="alternating repetitions (the median is reported)")
    parser.add_argument("--quick", action="store_true", help="only float32 1024^3")
    args = parser.parse_args()
    cpu = jax.devices("cpu")[0]
    rng = np.random.default_rng(0)
    dot = jax.jit(lambda a, b: jnp.dot(a, b))
    det = jax.jit(jaxdet.matmul)
    print(header(f"jaxdet CPU GEMM variant: {_native.cpu_gemm_isa()}, {len(jax.devices('cpu'))} CPU device(s)"))
    print(
        f"{'dtype':>8} {'M':>6} {'K':>6} {'N':>6} | {'jnp.dot ms':>10} {'GFLOP/s':>8} | {'jaxdet ms':>10} {'GFLOP/s':>8} | {'ratio':>6}"  # noqa: E501
    )
    shapes = SHAPES[:1] if args.quick else SHAPES
    dtypes = [jnp.float32] if args.quick else [jnp.float32, jnp.bfloat16]
    for dtype in dtypes:
        for M, K, N in shapes:
            with jax.default_device(cpu):
                inputs = guard(
                    lambda M=M, K=K, N=N, dtype=dtype: (
                        jnp.asarray(rng.standard_normal((M, K)), dtype),
                        jnp.asarray(rng.standard_normal((K, N)), dtype),
                    )
                )
                t_dot, t_det = pair_or_each(
                    lambda f, g: _median_times((f, g), inputs, args.reps),
                    lambda f: _median_times((f,), inputs, args.reps)[0],
                    *((inputs, inputs) if failed(inputs) else (dot, det)),
                )
            flops = 2.0 * M * N * K
            ratio = "-" if failed(t_dot) or failed(t_det) else f"{t_dot / t_det:.2f}"
            print(
                f"{jnp.dtype(dtype).name:>8} {M:>6} {K:>6} {N:>6} | {t_dot * 1e3:>10.3f} {flops / t_dot / 1e9:>8.1f} | "
                f"{t_det * 1e3:>10.3f} {flops / t_det / 1e9:>8.1f} | {ratio:>6}"
            )


if __name__ == "__main__":
    main()
