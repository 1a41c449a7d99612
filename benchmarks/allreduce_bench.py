"""jaxdet.parallel.tree_psum vs lax.psum, side by side in one run, on all local devices.

    python benchmarks/allreduce_bench.py [--sizes-mb 4,256] [--reps 20] [--inner 5] [--out results.md]
    python benchmarks/allreduce_bench.py --cpu-devices 8 --sizes-mb 1      # smoke test, simulated CPU devices

Each device holds a float32 buffer of the given size (the per-device gradient); both all-reduces run
inside a jitted `jax.shard_map` over a 1-D mesh of all devices with `out_specs=P()`. Timing: warm-up,
then the median over `--reps` timings of `--inner` back-to-back calls, the two sides alternating
(matmul_bench.timeit_pair). The bits column counts the elements where psum's result differs from the
canonical tree's (psum's order is the collective library's). On GPUs set NCCL_NVLS_ENABLE=0
(docs/parallel.md).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _parallel_bench import devices_label, emit, mesh_of_all_devices, parse_args  # noqa: E402


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-mb", default="4,256")
    return parse_args(p, reps=20, inner=5)


def main():
    args = parse()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from matmul_bench import timeit_pair

    from jaxdet.parallel import tree_psum

    devices, mesh = mesh_of_all_devices()
    d = len(devices)
    spec = {"mesh": mesh, "in_specs": P("d"), "out_specs": P()}
    f_psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x[0], "d"), **spec))
    f_tree = jax.jit(jax.shard_map(lambda x: tree_psum(x[0], "d"), **spec))
    rows = []
    for mb in (float(s) for s in args.sizes_mb.split(",")):
        n = int(mb * 2**20) // 4
        x = jax.device_put(
            jax.random.normal(jax.random.key(0), (d, n), jnp.float32)
            * jnp.exp(jax.random.normal(jax.random.key(1), (d, 1))),
            NamedSharding(mesh, P("d")),
        )
        t_psum, t_tree = timeit_pair(f_psum, f_tree, [(x,)], args.reps, args.inner)
        a, b = f_psum(x), f_tree(x)
        same_devices = len({np.asarray(s.data).tobytes() for s in b.addressable_shards}) == 1
        differ = int(
            jnp.sum(jax.lax.bitcast_convert_type(a, jnp.uint32) != jax.lax.bitcast_convert_type(b, jnp.uint32))
        )
        rows.append((mb, t_psum, t_tree, differ, n, same_devices))
        del x, a, b
    emit(
        f"All-reduce, float32, {devices_label(devices)}",
        [
            "MB per device",
            "psum ms",
            "tree_psum ms",
            "tree / psum",
            "elements psum != tree",
            "tree equal on all devices",
        ],
        [
            [f"{mb:g}", f"{tp:.3f}", f"{tt:.3f}", f"{tt / tp:.2f}x", f"{differ}/{n}", same]
            for mb, tp, tt, differ, n, same in rows
        ],
        args.out,
    )


if __name__ == "__main__":
    main()
