"""A data-parallel train step: jaxdet.parallel.value_and_grad vs the same step with lax.psum, one run.

    python benchmarks/dp_step_bench.py [--features 4096 --hidden 16384 --outputs 4096]
                                       [--tokens-per-device 16384] [--leaves-per-device 1,2]
                                       [--dtype bfloat16] [--reps 10] [--inner 3] [--out results.md]
    python benchmarks/dp_step_bench.py --cpu-devices 8 --features 64 --hidden 128 --outputs 32 \\
        --tokens-per-device 64 --dtype float32                               # smoke test

The step is make_step of jaxdet/_src/parallel/contracts.py (the model of the device-count tests,
scaled up):
x -> jaxdet.matmul -> tanh -> jaxdet.dropout (by global element index) -> jaxdet.matmul -> squared
error; then jaxdet.clip_by_global_norm and optax.adamw, all in one jit over a 1-D mesh of all local
devices. The psum step computes each device's gradient over its whole shard at once and sums the
float32 gradients with lax.psum; the jaxdet step splits the shard into `leaves-per-device` leaves
(one gradient each, combined by the canonical tree) and all-reduces with tree_psum. With one leaf per
device both run the same GEMMs, so the ratio is the cost of the deterministic all-reduce; with more,
it adds the cost of smaller GEMMs in a loop. Timing: warm-up, median of `--reps` timings of
`--inner` steps, alternating (matmul_bench.timeit_pair). On GPUs set NCCL_NVLS_ENABLE=0. A cell
that fails (out of memory) shows "OOM" or the exception's class and the run goes on (_timing.guard).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _parallel_bench import devices_label, emit, mesh_of_all_devices, parse_args, time_pair_or_each  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--features", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=16384)
    p.add_argument("--outputs", type=int, default=4096)
    p.add_argument("--tokens-per-device", type=int, default=16384)
    p.add_argument("--leaves-per-device", default="1,2", help="gradient leaves per device (comma-separated)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    return parse_args(p, reps=10, inner=3)


def main():
    args = parse()
    import jax
    import ml_dtypes
    import numpy as np
    from _timing import failed
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxdet
    import jaxdet._src.parallel.contracts as fp

    dtype = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else np.float32
    devices, mesh = mesh_of_all_devices()
    d = len(devices)
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))
    params = jax.device_put(fp.init_params(args.features, args.hidden, args.outputs, dtype=dtype), rep)
    opt_state = jax.device_put(fp._optimizer().init(params), rep)
    batch = fp._global_batch(
        fp.make_batches(1, d * args.tokens_per_device, args.features, args.outputs, dtype=dtype)[0],
        shard,
    )
    key = np.asarray(jaxdet.random.key(0))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    rows = []
    for per in (int(v) for v in args.leaves_per_device.split(",")):
        # Steps are timed without donation, so both sides read the same params every call.
        tree_step = fp.make_step(mesh, leaves=d * per)
        psum_step = fp.make_step(mesh, control=True)
        t_psum, t_tree = time_pair_or_each(
            psum_step, tree_step, [(params, opt_state, batch, key)], args.reps, args.inner
        )
        rows.append((per, t_psum, t_tree))
    emit(
        (
            f"Data-parallel train step, {devices_label(devices)}, {args.dtype}, {n_params / 1e6:.1f}M params "
            f"({args.features}->{args.hidden}->{args.outputs}), {args.tokens_per_device} tokens per device"
        ),
        ["leaves per device", "psum step ms", "jaxdet.parallel step ms", "ratio"],
        [[per, f"{tp:.3f}", f"{tt:.3f}", "-" if failed(tt / tp) else f"{tt / tp:.3f}x"] for per, tp, tt in rows],
        args.out,
    )


if __name__ == "__main__":
    main()
