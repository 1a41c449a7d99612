"""Where the time of a jitted computation goes: a jax.profiler trace, summarised as text.

    from trace_summary import traced
    print(traced(fn, args, iters=20, log_dir="/tmp/trace"))

Runs `fn(*args)` once untraced (compile, warm-up), then once under `jax.profiler` (CUPTI on a GPU)
and reads the Perfetto trace JSON that the profiler writes. Reports, per device: the span from the
first to the last kernel, the time at least one kernel was running (busy) and the idle gaps, and
the kernels by total time; for the host threads, the events by total time. A device that is idle
most of its span is waiting for the host (launch or dispatch cost), not for memory.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import shutil

import jax


def _events(log_dir):
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no perfetto_trace.json.gz under {log_dir}")
    with gzip.open(paths[-1]) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals):
    total, end = 0.0, -float("inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _table(es, top):
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in es:
        agg[e["name"]][0] += 1
        agg[e["name"]][1] += e["dur"]
    return [
        f"    {dur / 1e3:9.3f} ms  {n:6d} x  {name[:110]}"
        for name, (n, dur) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]
    ]


def summarize(log_dir, top=12):
    ev = _events(log_dir)
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e.get("tid")): e["args"]["name"] for e in ev if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    lines = []
    by_line = collections.defaultdict(list)
    for e in ev:
        if e.get("ph") == "X" and "dur" in e:
            by_line[(e["pid"], e.get("tid"))].append(e)
    for pid in sorted({p for p, _ in by_line}, key=lambda p: procs.get(p, "")):
        pname = procs.get(pid, str(pid))
        if "/device:" in pname:
            # One entry per device line (streams of kernels and copies, XLA ops, ...).
            for (p, tid), es in sorted(by_line.items(), key=lambda kv: str(kv[0][1])):
                if p != pid:
                    continue
                ivals = [(e["ts"], e["ts"] + e["dur"]) for e in es]
                start, stop = min(s for s, _ in ivals), max(e for _, e in ivals)
                busy = _union(ivals)
                lines.append(
                    f"{pname} / {threads.get((pid, tid), tid)}: {len(es)} events, span "
                    f"{(stop - start) / 1e3:.3f} ms, busy {busy / 1e3:.3f} ms "
                    f"({100 * busy / max(stop - start, 1e-9):.0f}%)"
                )
                lines += _table(es, top)
        else:
            es = [e for (p, _), line in by_line.items() if p == pid for e in line]
            lines.append(f"{pname}: {len(es)} events")
            lines += _table(es, top)
    return "\n".join(lines)


def traced(fn, args, log_dir="/tmp/jaxdet-trace", top=12):
    jax.block_until_ready(fn(*args))
    shutil.rmtree(log_dir, ignore_errors=True)
    jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
    try:
        jax.block_until_ready(fn(*args))
    finally:
        jax.profiler.stop_trace()
    return summarize(log_dir, top)
