"""Where does `jaxdet.invariant`'s train-step time go? (docs/invariant.md, "Speed and memory")

The step of benchmarks/invariant_bench.py (plain-JAX Llama, bf16, AdamW), timed untransformed and
transformed, then transformed with one rule at a time switched back to the operation as it was
(the bits are then no longer the rule's: a measurement, never a mode). The difference to the full
transformation is that rule's cost.

    python tools/experiments/invariant_cost_probe.py            # GPU, the benchmark's model
    python tools/experiments/invariant_cost_probe.py --small    # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import invariant_bench  # noqa: E402

from jaxdet._src.invariant import rules  # noqa: E402
from jaxdet.models import plain_llama as L  # noqa: E402

AS_IS = {
    "opaque add/sub": ("add", "sub", "add_any"),
    "divide": ("div",),
    "reduce_sum": ("reduce_sum",),
    "max/min": ("reduce_max", "reduce_min"),
    "dot_general": ("dot_general",),
    "scatter-add": ("scatter-add", "scatter_add"),
}


def as_is(eqn, *xs, unsupported=None):
    return eqn.primitive.bind(*xs, **eqn.params)


def bench_model(small, attention):
    """(config, batch, tokens) of benchmarks/invariant_bench.py's model (small: a CPU smoke size)."""
    if small:
        cfg = L.Config(vocab=512, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=512, max_len=64)
        B, T = 2, 64
    else:
        cfg = L.Config(vocab=32000, d_model=2048, n_layers=8, n_heads=16, n_kv_heads=8, d_ff=8192, max_len=2048)
        B, T = 4, 2048
    return dataclasses.replace(cfg, dtype=jnp.bfloat16, attention=attention), B, T


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--attention", default="cudnn", choices=["cudnn", "xla"])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    cfg, B, T = bench_model(args.small, args.attention)
    t = jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg.vocab)
    tokens, targets = t[:, :-1], t[:, 1:]
    plain = invariant_bench.measure(cfg, False, tokens, targets, args.reps)[0]
    full = invariant_bench.measure(cfg, True, tokens, targets, args.reps)[0]
    print(
        f"{jax.devices()[0].device_kind}, attention {args.attention}: plain {plain * 1e3:.1f} ms, "
        f"invariant {full * 1e3:.1f} ms ({full / plain:.3f}x)"
    )
    print("| rule switched off | step (ms) | saves (ms) |\n|---|---:|---:|")
    for name, prims in AS_IS.items():
        saved = {n: rules.RULES[n] for n in prims}
        rules.RULES.update({n: as_is for n in prims})
        try:
            step = invariant_bench.measure(cfg, True, tokens, targets, args.reps)[0]
            print(f"| {name} | {step * 1e3:.1f} | {(full - step) * 1e3:.1f} |", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print(f"| {name} | {type(e).__name__}: {str(e)[:80]} | - |", flush=True)
        finally:
            rules.RULES.update(saved)


if __name__ == "__main__":
    main()
