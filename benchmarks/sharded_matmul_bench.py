"""jaxdet.matmul under sharded jit vs the per-shard call on one device, side by side in one run.

    python benchmarks/sharded_matmul_bench.py [--tokens-per-device 8192] [--k 4096] [--n 4096,14336]
                                              [--reps 20] [--inner 5] [--out results.md]
    python benchmarks/sharded_matmul_bench.py --cpu-devices 8 --tokens-per-device 64 --k 64 --n 32 \\
        --dtype float32 --reps 2 --inner 1                                   # smoke test

Two layouts over a 1-D mesh of all local devices (docs/sharding.md): data parallel (`a` sharded on
its rows, `b` replicated) and tensor parallel (`a` replicated, `b` sharded on N). The partitioning
rule runs each device's block as its own call, so the sharded product should take the time of one
device's call on its block alone (the "per-shard" column: `jaxdet.matmul` of a block on the first
device) and compile to no collective (the "collectives" column, read from the compiled HLO). The
bits column compares the sharded result with the unsharded call on the first device. A cell that
fails (out of memory) shows "OOM" or the exception's class and the run goes on (_timing.guard).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _parallel_bench import (  # noqa: E402
    collectives_in,
    devices_label,
    emit,
    mesh_of_all_devices,
    parse_args,
    time_pair_or_each,
)


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens-per-device", type=int, default=8192)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", default="4096,14336", help="comma-separated output widths (the whole b)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    return parse_args(p, reps=20, inner=5)


def main():
    args = parse()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from _timing import failed, guard
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxdet

    devices, mesh = mesh_of_all_devices()
    d = len(devices)
    dtype = jnp.dtype(args.dtype)
    t, k = args.tokens_per_device, args.k
    layouts = {  # name: (a's spec, b's spec, the first device's block of a, of b)
        "data parallel": (P("d", None), P(), lambda a: a[:t], lambda b: b),
        "tensor parallel": (P(), P(None, "d"), lambda a: a, lambda b: b[:, : b.shape[1] // d]),
    }
    rows = []
    for n in (int(v) for v in args.n.split(",")):
        if n % d:
            raise SystemExit(f"--n {n} is not a multiple of the {d} devices")
        ka, kb = jax.random.split(jax.random.key(0))

        def operands(n=n):
            a_host = jax.random.normal(ka, (d * t, k), jnp.float32).astype(dtype)
            b_host = (jax.random.normal(kb, (k, n), jnp.float32) / np.sqrt(k)).astype(dtype)
            whole = np.asarray(jaxdet.matmul(a_host, b_host))  # the unsharded call, on the first device
            return a_host, b_host, whole

        got = guard(operands)
        if failed(got):
            rows += [[name, d * t, k, n] + [got] * 5 for name in layouts]
            continue
        a_host, b_host, whole = got
        del got
        for name, (spec_a, spec_b, block_a, block_b) in layouts.items():
            sharded = jax.jit(jaxdet.matmul)
            local = jax.jit(jaxdet.matmul)

            def placed(spec_a=spec_a, spec_b=spec_b, block_a=block_a, block_b=block_b):
                a = jax.device_put(a_host, NamedSharding(mesh, spec_a))
                b = jax.device_put(b_host, NamedSharding(mesh, spec_b))
                a0 = jax.device_put(block_a(a_host), devices[0])
                b0 = jax.device_put(block_b(b_host), devices[0])
                return a, b, a0, b0

            got = guard(placed)
            if failed(got):
                rows.append([name, d * t, k, n] + [got] * 5)
                continue
            a, b, a0, b0 = got
            del got
            found = guard(lambda a=a, b=b: ", ".join(collectives_in(sharded.lower(a, b).compile().as_text())) or "none")
            t_local, t_sharded = time_pair_or_each(
                lambda _a, _b, a0=a0, b0=b0: local(a0, b0), sharded, [(a, b)], args.reps, args.inner
            )
            same = guard(
                lambda a=a, b=b: np.array_equal(np.asarray(sharded(a, b)).view(np.uint8), whole.view(np.uint8))
            )
            rows.append(
                [
                    name,
                    d * t,
                    k,
                    n,
                    f"{t_local:.3f}",
                    f"{t_sharded:.3f}",
                    f"{t_sharded / t_local:.3f}",
                    found,
                    same,
                ]
            )
            del a, b, a0, b0
    emit(
        f"Sharded-jit jaxdet.matmul vs the per-shard call, {args.dtype}, {devices_label(devices)}",
        [
            "layout",
            "M",
            "K",
            "N",
            "per-shard ms",
            "sharded ms",
            "sharded / per-shard",
            "collectives",
            "bits = unsharded",
        ],
        rows,
        args.out,
    )


if __name__ == "__main__":
    main()
