"""Set-up and output shared by the multi-device benchmarks (allreduce_bench.py, dp_step_bench.py,
sharded_matmul_bench.py).

Nothing here imports jax at module level: `--cpu-devices` must set XLA_FLAGS before jax starts.
"""

from __future__ import annotations

import os


def parse_args(parser, reps, inner):
    """Adds --reps, --inner, --cpu-devices and --out to `parser` and parses; with --cpu-devices, JAX
    (not imported yet) will run on that many simulated CPU devices."""
    parser.add_argument("--reps", type=int, default=reps, help="timings per cell (the median is reported)")
    parser.add_argument("--inner", type=int, default=inner, help="back-to-back calls per timing")
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=0,
        help="simulate this many CPU devices (smoke test)",
    )
    parser.add_argument("--out", default="", help="also append the table to this file")
    args = parser.parse_args()
    if args.cpu_devices:
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.cpu_devices}"
        )
        os.environ["JAX_PLATFORMS"] = "cpu"
    return args


def mesh_of_all_devices():
    """(devices, a 1-D mesh "d" over all of them)."""
    import jax
    import numpy as np

    devices = jax.devices()
    return devices, jax.sharding.Mesh(np.array(devices), ("d",))


def collectives_in(compiled_text):
    """The collective ops a compiled HLO module runs (an async start/done pair counts as its op)."""
    import re

    ops = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
    return sorted(set(re.findall(r"\b(" + "|".join(ops) + r")(?:-start)?\(", compiled_text)))


def devices_label(devices):
    return f"{len(devices)} x {getattr(devices[0], 'device_kind', devices[0].platform)}"


def time_pair_or_each(fn_a, fn_b, argsets, reps, inner):
    """(ms of fn_a, ms of fn_b) on argsets, alternating (matmul_bench.timeit_pair), or each alone
    when the pair fails: a side that fails shows "OOM" or its exception's class (_timing.guard)."""
    from _timing import pair_or_each
    from matmul_bench import timeit, timeit_pair

    return pair_or_each(
        lambda a, b: timeit_pair(a, b, argsets, reps, inner),
        lambda f: timeit(f, argsets, reps, inner),
        fn_a,
        fn_b,
    )


def emit(title, columns, rows, out):
    """Prints the markdown table (a title line, the header line of _timing.header with
    NCCL_NVLS_ENABLE, then the table's header and a row per entry of `rows`, each a list of cells)
    and appends it to the file `out` when given."""
    from _timing import header

    cells = lambda values: "| " + " | ".join(str(v) for v in values) + " |"
    lines = [
        title,
        "",
        header(f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', 'unset')}"),
        "",
        cells(columns),
        "|" + "---|" * len(columns),
    ]
    lines += [cells(r) for r in rows]
    text = "\n".join(lines)
    print(text)
    if out:
        with open(out, "a") as fh:
            fh.write(text + "\n\n")
