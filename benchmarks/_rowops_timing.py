"""Command line, timing and table rows shared by norm_bench.py, softmax_bench.py and reduce_bench.py:
the baseline and jaxdet side by side, in alternating repetitions, forward and backward separately
(reduce_bench.py: forward only), with the fraction of the copy bandwidth reached.

Forward: the jitted function. Backward: the jitted vjp function applied to the cotangent, the
forward's residuals passed in as arguments (`jax.vjp` outside the timed call), so each side is
timed on the computation its backward really runs. Each sample is `calls` back-to-back calls with
one `jax.block_until_ready` at the end; the median over `reps` samples is reported, and the two
sides alternate (which goes first alternates too), so clock or power drift hits both alike. A side
that fails (its forward, its vjp or its timing) shows "OOM" or the exception's class in its cell and
the other side is timed alone (_timing.guard, _timing.pair_or_each).
"""

from __future__ import annotations

import statistics
import sys

import jax
import jax.numpy as jnp
from _timing import Failed, failed, guard, header, pair_or_each, sample


def time_pair(a, b, reps, calls):
    """Median seconds per call of a() and b() (each a (fn, args) pair), in alternating repetitions."""
    for fn, args in (a, b):
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    ta, tb = [], []
    for r in range(reps):
        order = ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta))
        for (fn, args), out in order:
            out.append(sample(fn, args, calls))
    return statistics.median(ta), statistics.median(tb)


def time_one(a, reps, calls):
    """Median seconds per call of a() (a (fn, args) pair), after two warm-up calls."""
    fn, args = a
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    return statistics.median(sample(fn, args, calls) for _ in range(reps))


def forward_and_backward(f, args, cotangent):
    """((fwd_fn, args), (bwd_fn, (vjp, cotangent))) for timing f's forward and its backward."""
    fwd = jax.jit(f)
    out, vjp = jax.vjp(f, *args)
    bwd = jax.jit(lambda vjp, g: vjp(g))
    # A baseline may return another dtype than jaxdet (optax's bfloat16 loss for bfloat16 logits,
    # jaxdet's float32): each backward gets the cotangent in its own output's dtype.
    return (fwd, args), (bwd, (vjp, cotangent.astype(out.dtype)))


def timing_pairs(f, args, cotangent):
    """forward_and_backward, or (Failed, Failed) when it fails (its forward runs: out of memory) or
    when an input is a Failed already (the inputs did not fit)."""
    for x in (*args, cotangent):
        if failed(x):
            return x, x
    both = guard(forward_and_backward, f, args, cotangent)
    return (both, both) if isinstance(both, Failed) else both


def parse_args(parser, default_dtype):
    """Adds the arguments every row-op benchmark takes (--dtype, of which `default_dtype` is the
    default) and parses: (args, the device to run on). Exits when that device is the CPU and
    --allow-cpu is not given."""
    parser.add_argument("--dtype", default=default_dtype, choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--small", action="store_true", help="small shapes (CPU smoke test)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no GPU")
    parser.add_argument("--sanitize", action="store_true", help="every kernel path once, small (compute-sanitizer)")
    args = parser.parse_args()
    device = jax.devices()[0]
    if device.platform == "cpu" and not args.allow_cpu:
        sys.exit("no GPU: pass --allow-cpu (with --small) to smoke-test the script on the CPU")
    return args, device


def main(parser, default_dtype, sanitize, benchmark):
    """A row-op benchmark's command line: parses (parse_args), then runs sanitize(device) with
    --sanitize, else benchmark(args, device, dtype)."""
    args, device = parse_args(parser, default_dtype)
    if args.sanitize:
        sanitize(device)
    else:
        benchmark(args, device, jnp.dtype(args.dtype))


def copy_bandwidth(device, small=False, reps=10):
    """Bytes per second of `x * 1.5` on a float32 array (read + write) of 1 GiB (small: 16 MiB); a
    Failed if it does not run."""
    nbytes = (16 << 20) if small else (1 << 30)

    def measure():
        x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
        f = jax.jit(lambda x: x * 1.5)
        return statistics.median(sample(f, (x,), 5) for _ in range(reps))

    return 2 * nbytes / guard(measure)


def print_header(what, args, device, baseline="jnp"):
    """Measures the copy bandwidth and prints the benchmark's header line (_timing.header: device,
    jax and jaxdet versions, date; then `what`, the bandwidth and how the times are taken), then a
    blank line. Returns the bandwidth (bytes per second) for print_timed_row."""
    bandwidth = copy_bandwidth(device, args.small)
    what = (
        f"{what}, copy bandwidth {bandwidth / 1e9:.0f} GB/s, median of {args.reps} x {args.calls} "
        f"back-to-back calls, {baseline} and jaxdet alternating"
    )
    print(header(what) + "\n", flush=True)
    return bandwidth


def nbytes(*arrays_or_shapes_dtypes):
    total = 0
    for shape, dtype in arrays_or_shapes_dtypes:
        n = 1
        for d in shape:
            n *= d
        total += n * jnp.dtype(dtype).itemsize
    return total


def row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def print_table_header(keys, baseline):
    """The markdown header: the `keys` columns, then the timing columns of `print_timed_row`."""
    print(
        row(
            keys
            + [
                f"{baseline} ms",
                "jaxdet ms",
                f"ratio ({baseline}/jaxdet)",
                "jaxdet GB/s",
                "fraction of copy bw",
            ]
        )
    )
    print(row(["---"] * (len(keys) + 5)))


def print_timed_row(keys, baseline, jaxdet_pair, moved, bandwidth, args):
    """Times the baseline and jaxdet (time_pair) and prints their row: times, ratio, and `moved`
    bytes per second of jaxdet's time, absolute and as a fraction of `bandwidth`."""
    tb, td = pair_or_each(
        lambda a, b: time_pair(a, b, reps=args.reps, calls=args.calls),
        lambda a: time_one(a, reps=args.reps, calls=args.calls),
        baseline,
        jaxdet_pair,
    )
    print(
        row(
            keys
            + [
                f"{tb * 1e3:.4f}",
                f"{td * 1e3:.4f}",
                "-" if failed(tb) or failed(td) else f"{tb / td:.3f}",
                f"{moved / td / 1e9:.0f}",
                f"{moved / td / bandwidth:.2f}",
            ]
        ),
        flush=True,
    )
