"""Wall-clock timing of jitted calls, shared by the benchmarks.

A sample is `calls` back-to-back calls with one `jax.block_until_ready` at the end (seconds per
call), so the launch overhead overlaps with the work the way it does in a training step.
"""

from __future__ import annotations

import statistics
import time

import jax


def sample(fn, args, calls):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def timed(fn, *args, reps: int = 10, inner: int = 5) -> float:
    """Median seconds per call over `reps` samples of `inner` calls, after two warm-up calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    return statistics.median(sample(fn, args, inner) for _ in range(reps))
