"""jaxdet.parallel.tree_psum vs lax.psum, side by side in one run, on all local devices.

    python benchmarks/allreduce_bench.py [--sizes-mb 4,256] [--reps 20] [--inner 5] [--out results.md]
    python benchmarks/allreduce_bench.py --cpu-devices 8 --sizes-mb 1 --reps 2 --inner 1   # smoke test (CPU)

Each device holds a float32 buffer of the given size (the per-device gradient); both all-reduces run
inside a jitted `jax.shard_map` over a 1-D mesh of all devices with `out_specs=P()`. Timing: warm-up,
then the median over `--reps` timings of `--inner` back-to-back calls, the two sides alternating
(matmul_bench.timeit_pair). The bits column counts the elements where psum's result differs from the
canonical tree's (psum's order is the collective library's). On GPUs set NCCL_NVLS_ENABLE=0
(docs/parallel.md). A cell that fails (out of memory) shows "OOM" or the exception's class.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _parallel_bench import devices_label, emit, mesh_of_all_devices, parse_args, time_pair_or_each  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="4,256", help="per-device buffer sizes, MB (comma-separated)")
    return parse_args(p, reps=20, inner=5)


def main():
    args = parse()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _timing import failed, guard
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxdet.parallel import tree_psum

    devices, mesh = mesh_of_all_devices()
    d = len(devices)
    spec = {"mesh": mesh, "in_specs": P("d"), "out_specs": P()}
    f_psum = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x[0], "d"), **spec))
    f_tree = jax.jit(jax.shard_map(lambda x: tree_psum(x[0], "d"), **spec))
    rows = []
    for mb in (float(s) for s in args.sizes_mb.split(",")):
        n = int(mb * 2**20) // 4

        def buffers(n=n):
            return jax.device_put(
                jax.random.normal(jax.random.key(0), (d, n), jnp.float32)
                * jnp.exp(jax.random.normal(jax.random.key(1), (d, 1))),
                NamedSharding(mesh, P("d")),
            )

        x = guard(buffers)
        if failed(x):
            rows.append((mb, x, x, x, n, x))
            continue
        t_psum, t_tree = time_pair_or_each(f_psum, f_tree, [(x,)], args.reps, args.inner)

        def compare(x=x):
            a, b = f_psum(x), f_tree(x)
            same_devices = len({np.asarray(s.data).tobytes() for s in b.addressable_shards}) == 1
            differ = int(
                jnp.sum(jax.lax.bitcast_convert_type(a, jnp.uint32) != jax.lax.bitcast_convert_type(b, jnp.uint32))
            )
            return differ, same_devices

        checked = guard(compare)
        differ, same_devices = (checked, checked) if failed(checked) else checked
        rows.append((mb, t_psum, t_tree, differ, n, same_devices))
        del x
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
            [f"{mb:g}", f"{tp:.3f}", f"{tt:.3f}", "-" if failed(tt / tp) else f"{tt / tp:.2f}x", f"{differ}/{n}", same]
            for mb, tp, tt, differ, n, same in rows
        ],
        args.out,
    )


if __name__ == "__main__":
    main()
