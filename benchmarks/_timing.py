"""Timing, failure guard and header shared by the benchmarks.

Timing: a sample is `calls` back-to-back calls with one `jax.block_until_ready` at the end (seconds
per call), so the launch overhead overlaps with the work the way it does in a training step.

Failures: every cell of a benchmark (a baseline or a jaxdet timing, its inputs, a bits check) runs
through `guard`. A cell that raises (out of memory, a shape an implementation does not support, a
compile error) becomes a `Failed`, printed in its cell as "OOM" or the exception's class, and the
benchmark goes on to the next cell; the exception's first line goes to stderr.

Nothing here imports jax at module level: the multi-device benchmarks set XLA_FLAGS before jax
starts (_parallel_bench.py).
"""

from __future__ import annotations

import datetime
import gc
import statistics
import sys
import time

# Substrings of the messages of an out-of-memory failure (XLA's RESOURCE_EXHAUSTED, the allocator's,
# cuDNN's and the CUDA runtime's).
_OOM_MARKS = ("resource_exhausted", "out of memory", "failed to allocate", "oom when allocating")


class Failed:
    """A cell whose computation raised. Prints as its label ("OOM" or the exception's class) under
    any format spec, and arithmetic with it gives itself, so a time, a ratio or a bandwidth derived
    from a failed cell shows the failure instead of stopping the benchmark."""

    def __init__(self, label: str):
        self.label = label

    def __str__(self):
        return self.label

    __repr__ = __str__

    def __format__(self, spec):
        return self.label

    def _same(self, *_):
        return self

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _same
    __truediv__ = __rtruediv__ = __neg__ = __abs__ = _same


def failure_label(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".lower()
    return "OOM" if any(mark in text for mark in _OOM_MARKS) else type(err).__name__


def failed(x) -> bool:
    return isinstance(x, Failed)


def guard(fn, *args, **kwargs):
    """fn(*args, **kwargs), or a Failed if it raises (or if one of `args` is a Failed already: a
    cell whose input failed fails the same way, without running)."""
    for a in args:
        if isinstance(a, Failed):
            return a
    try:
        return fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001  (any failure of a cell is reported in that cell)
        label = failure_label(err)
        first = (str(err).strip().splitlines() or [""])[0][:300]
        print(
            f"[{label}] {getattr(fn, '__name__', 'cell')}: {type(err).__name__}: {first}", file=sys.stderr, flush=True
        )
    # Out of the except clause: the traceback (and the arrays its frames hold) is gone; free them
    # before the next cell allocates.
    gc.collect()
    return Failed(label)


def pair_or_each(time_pair, time_one, a, b):
    """(time of a, time of b): time_pair(a, b) (the two alternating), or, when that fails or one side
    is a Failed already, each side alone through time_one, so that the side that runs keeps its
    number and the other shows its failure."""
    if not failed(a) and not failed(b):
        both = guard(time_pair, a, b)
        if not failed(both):
            return both
    return guard(time_one, a), guard(time_one, b)


def fastest(times: dict):
    """(name, seconds) of the fastest entry of {name: seconds or Failed} that ran; (None, Failed)
    when none did."""
    ran = {name: t for name, t in times.items() if not failed(t)}
    if not ran:
        return None, next(iter(times.values()), Failed("-"))
    name = min(ran, key=ran.get)
    return name, ran[name]


def header(what: str = "") -> str:
    """One line naming the device, the jax and jaxdet versions and today's date (then `what`)."""
    import jax

    try:
        import jaxdet

        version = f"jaxdet {jaxdet.__version__}"
    except Exception as err:  # noqa: BLE001
        version = f"jaxdet not importable ({type(err).__name__})"
    devices = jax.devices()
    kind = getattr(devices[0], "device_kind", devices[0].platform)
    count = f"{len(devices)} x " if len(devices) > 1 else ""
    line = f"device: {count}{kind} ({devices[0].platform}); jax {jax.__version__}; {version}; {datetime.date.today()}"
    return f"{line}; {what}" if what else line


def sample(fn, args, calls):
    import jax

    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls


def timed(fn, *args, reps: int = 10, inner: int = 5) -> float:
    """Median seconds per call over `reps` samples of `inner` calls, after two warm-up calls."""
    import jax

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    return statistics.median(sample(fn, args, inner) for _ in range(reps))
