"""Benchmark: jaxdet softmax / log_softmax / cross-entropy vs jax.nn and optax, forward and backward.

    python benchmarks/softmax_bench.py                      # GPU: markdown table for benchmarks/RESULTS.md
    python benchmarks/softmax_bench.py --dtype bfloat16 --tokens 1,64,4096,16384
    python benchmarks/softmax_bench.py --sanitize           # every kernel path once, small (compute-sanitizer)
    python benchmarks/softmax_bench.py --allow-cpu --small  # smoke-test the script without a GPU

Rows of vocab 128256 (--small: 3000), tokens 1, 64, 4096 by default. Baselines: jax.nn.softmax,
jax.nn.log_softmax, optax.softmax_cross_entropy_with_integer_labels (in the logits' dtype, as
users call them). Forward and backward timed separately (_rowops_timing.py); ratio = baseline
time / jaxdet time (>= 0.9 is the target); a cell that fails shows "OOM" or the exception's
class. Bandwidth: the minimal bytes (forward: read x, write y (softmax, log_softmax) or only read
the logits (cross-entropy); backward: read x and g, write dx, or read the logits and write their
gradient (cross-entropy)) per second, and its fraction of the copy bandwidth measured in the same
run.
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


def baselines():
    import optax

    return {
        "softmax": (jax.nn.softmax, jaxdet.softmax),
        "log_softmax": (jax.nn.log_softmax, jaxdet.log_softmax),
        "cross_entropy": (
            optax.softmax_cross_entropy_with_integer_labels,
            jaxdet.softmax_cross_entropy_with_integer_labels,
        ),
    }


def inputs(tokens, vocab, dtype, device):
    rng = np.random.default_rng(0)
    x = jax.device_put(jnp.asarray(rng.standard_normal((tokens, vocab), np.float32) * 3).astype(dtype), device)
    g = jax.device_put(jnp.asarray(rng.standard_normal((tokens, vocab), np.float32)).astype(dtype), device)
    labels = jax.device_put(jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32), device)
    gl = jax.device_put(jnp.asarray(rng.standard_normal(tokens), jnp.float32), device)
    return x, g, labels, gl


def cases(mode, fns, x, g, labels, gl, pairs=rt.forward_and_backward):
    """((fwd, args), (bwd, args)) for the baseline and for jaxdet (pairs: rt.timing_pairs gives
    (Failed, Failed) for a side that fails)."""
    out = []
    for f in fns:
        if mode == "cross_entropy":
            # labels are an argument (not a constant) and receive no cotangent.
            out.append(pairs(lambda x, f=f: f(x, labels), (x,), gl))
        else:
            out.append(pairs(f, (x,), g))
    return out


def sanitize(device):
    """Every kernel path once: one-segment rows (1, 2, 4, 8 register steps), rows of 2-16 segments
    (clusters on Hopper; the pass kernels under JAXDET_TESTING=softmax=passes) and of 18 segments."""
    shapes = ((3, 5), (9, 1027), (4, 2048), (3, 4096), (2, 8192), (3, 8193), (2, 20000), (2, 128256), (2, 140001))
    for tokens, vocab in shapes:
        x, g, labels, gl = inputs(tokens, vocab, jnp.bfloat16, device)
        for mode, (_, f) in baselines().items():
            (fwd, a), (bwd, b) = cases(mode, (f,), x, g, labels, gl)[0]
            jax.block_until_ready((fwd(*a), bwd(*b)))
    print("sanitize: every softmax kernel path ran once")


def benchmark(args, device, dtype):
    vocab = args.vocab or (3000 if args.small else 128256)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else ([1, 8, 64] if args.small else [1, 64, 4096])
    bw = rt.print_header(f"{dtype.name} logits, vocab {vocab}", args, device, baseline="the baseline")
    rt.print_table_header(["op", "pass", "tokens", "vocab"], "baseline")
    for mode, fns in baselines().items():
        for t in tokens:
            got = guard(inputs, t, vocab, dtype, device)
            x, g, labels, gl = (got,) * 4 if failed(got) else got
            (bf, bb), (jf, jb) = cases(mode, fns, x, g, labels, gl, pairs=rt.timing_pairs)
            act = ((t, vocab), dtype)
            fwd_bytes = rt.nbytes(act) if mode == "cross_entropy" else rt.nbytes(act, act)
            bwd_bytes = rt.nbytes(act, act) if mode == "cross_entropy" else rt.nbytes(act, act, act)
            for name, base, det, moved in (("fwd", bf, jf, fwd_bytes), ("bwd", bb, jb, bwd_bytes)):
                rt.print_timed_row([mode, name, t, vocab], base, det, moved, bw, args)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default=None, help="comma-separated token counts (default 1,64,4096)")
    p.add_argument("--vocab", type=int, default=None)
    rt.main(p, "float32", sanitize, benchmark)


if __name__ == "__main__":
    main()
