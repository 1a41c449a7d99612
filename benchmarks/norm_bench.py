"""Benchmark: jaxdet.rms_norm / layer_norm vs the jnp versions, forward and backward, side by side.

    python benchmarks/norm_bench.py                      # GPU: markdown table for benchmarks/RESULTS.md
    python benchmarks/norm_bench.py --dtype float32
    python benchmarks/norm_bench.py --sanitize           # every kernel path once, small (compute-sanitizer)
    python benchmarks/norm_bench.py --allow-cpu --small  # smoke-test the script without a GPU

Shapes (tokens, d): (1, 4096), (64, 4096), (16384, 4096) (--small: (1, 256), (64, 256), (512, 256)).
The jnp versions are the usual float32-statistics formulations (flax's RMSNorm / LayerNorm):
x widened to float32, mean / var reductions, the output cast back. Forward: y from (x, scale[, bias]).
Backward: dx, dscale[, dbias] from the cotangent and the forward's residuals (_rowops_timing.py).
ratio = jnp time / jaxdet time (>= 0.9 is the target); a cell that fails shows "OOM" or the
exception's class. Bandwidth: the minimal bytes (forward: read x,
write y; backward: read x and g, write dx; parameters and statistics ignored) per second, and its
fraction of the copy bandwidth measured in the same run (`x * 1.5`, float32, 1 GiB).
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

EPS = 1e-6


def jnp_rms_norm(x, scale):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS)
    return (y * scale.astype(jnp.float32)).astype(x.dtype)


def jnp_layer_norm(x, scale, bias):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + EPS)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


IMPLS = {
    "rms": (lambda x, w, b: jnp_rms_norm(x, w), lambda x, w, b: jaxdet.rms_norm(x, w, EPS)),
    "layer": (jnp_layer_norm, lambda x, w, b: jaxdet.layer_norm(x, w, b, EPS)),
}


def inputs(tokens, d, dtype, device):
    rng = np.random.default_rng(0)
    put = lambda a, dt: jax.device_put(jnp.asarray(a, jnp.float32).astype(dt), device)
    return (
        put(rng.standard_normal((tokens, d)), dtype),
        put(1 + 0.1 * rng.standard_normal(d), jnp.float32),
        put(0.1 * rng.standard_normal(d), jnp.float32),
    ), put(rng.standard_normal((tokens, d)), dtype)


def sanitize(device):
    """Every kernel path once: registers (1, 2, 4, 8 steps) and streamed rows, aligned or not."""
    for tokens, d in ((3, 5), (33, 1027), (5, 2048), (4, 4096), (3, 8192), (2, 9000)):
        args, g = inputs(tokens, d, jnp.bfloat16, device)
        for kind in IMPLS:
            (fwd, a), (bwd, b) = rt.forward_and_backward(IMPLS[kind][1], args, g)
            jax.block_until_ready((fwd(*a), bwd(*b)))
    print("sanitize: every norm kernel path ran once")


def benchmark(args, device, dtype):
    d = 256 if args.small else 4096
    shapes = [(1, d), (64, d), (512 if args.small else 16384, d)]
    bw = rt.print_header(dtype.name, args, device)
    rt.print_table_header(["op", "pass", "tokens", "d"], "jnp")
    for kind, (jnp_f, det_f) in IMPLS.items():
        for tokens, d in shapes:
            got = guard(inputs, tokens, d, dtype, device)
            xs, g = ((got,), got) if failed(got) else got
            jnp_fwd, jnp_bwd = rt.timing_pairs(jnp_f, xs, g)
            det_fwd, det_bwd = rt.timing_pairs(det_f, xs, g)
            act = ((tokens, d), dtype)
            for name, base, det, moved in (
                ("fwd", jnp_fwd, det_fwd, rt.nbytes(act, act)),
                ("bwd", jnp_bwd, det_bwd, rt.nbytes(act, act, act)),
            ):
                rt.print_timed_row([f"{kind}_norm", name, tokens, d], base, det, moved, bw, args)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    rt.main(p, "bfloat16", sanitize, benchmark)


if __name__ == "__main__":
    main()
