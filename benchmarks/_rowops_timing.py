"""Timing shared by norm_bench.py and softmax_bench.py: jnp and jaxdet side by side, in alternating
repetitions, forward and backward separately, with the fraction of the copy bandwidth reached.

Forward: the jitted function. Backward: the jitted vjp function applied to the cotangent, the
forward's residuals passed in as arguments (`jax.vjp` outside the timed call), so each side is
timed on the computation its backward really runs. Each sample is `calls` back-to-back calls with
one `jax.block_until_ready` at the end; the median over `reps` samples is reported, and the two
sides alternate (which goes first alternates too), so clock or power drift hits both alike.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def _sample(fn, args, calls):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def time_pair(a, b, reps, calls):
    """Median seconds per call of a() and b() (each a (fn, args) pair), in alternating repetitions."""
    for fn, args in (a, b):
        jax.block_until_ready(fn(*args))
        jax.block_until_ready(fn(*args))
    ta, tb = [], []
    for r in range(reps):
        order = ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta))
        for (fn, args), out in order:
            out.append(_sample(fn, args, calls))
    return statistics.median(ta), statistics.median(tb)


def forward_and_backward(f, args, cotangent):
    """((fwd_fn, args), (bwd_fn, (vjp, cotangent))) for timing f's forward and its backward."""
    fwd = jax.jit(f)
    _, vjp = jax.vjp(f, *args)
    bwd = jax.jit(lambda vjp, g: vjp(g))
    return (fwd, args), (bwd, (vjp, cotangent))


def copy_bandwidth(device, reps=10, nbytes=1 << 30):
    """Bytes per second of `x * 1.5` on a float32 array (read + write), on `device`."""
    x = jax.device_put(jnp.ones((nbytes // 4,), jnp.float32), device)
    f = jax.jit(lambda x: x * 1.5)
    t = statistics.median(_sample(f, (x,), 5) for _ in range(reps))
    return 2 * nbytes / t


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
