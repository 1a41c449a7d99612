"""Benchmark: a train step of a plain-JAX Llama-style model (jaxdet.models.plain_llama), transformed
by `jaxdet.invariant` vs the same step untransformed, with the user's attention as XLA and as
cuDNN (docs/invariant.md).

    python benchmarks/invariant_bench.py                       # GPU: d 2048, 8 layers, seq 2048, batch 4, bf16
    python benchmarks/invariant_bench.py --allow-cpu --small   # smoke test without a GPU

A step is the mean token loss, its gradient with respect to every parameter and an AdamW update
(donated). Per attention implementation it prints the step time (median), the compiled program's
temporary memory (XLA's memory analysis) and the time to trace and compile, for the untransformed
and the transformed step, and their ratios (goals: time <= 1.15 with cuDNN attention in the
user's code, <= 1.3 with XLA attention; memory <= 1.2; trace + compile <= 2). A cell that fails
(out of memory, an implementation this device lacks) prints its failure and the rest runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
from _timing import failed, guard  # noqa: E402

import jaxdet  # noqa: E402
from jaxdet.models import plain_llama as L  # noqa: E402


def make_step(cfg, transformed):
    tx = optax.adamw(1e-4)
    loss = functools.partial(L.loss, cfg=cfg)
    grad = jax.value_and_grad(jaxdet.invariant(loss) if transformed else loss)

    def step(params, opt_state, tokens, targets):
        value, grads = grad(params, tokens, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1)), tx


def measure(cfg, transformed, tokens, targets, reps):
    """(seconds per step, temporary bytes, seconds to trace and compile)."""
    step, tx = make_step(cfg, transformed)
    params = L.init(cfg, jax.random.key(0))
    opt_state = tx.init(params)
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, tokens, targets).compile()
    build = time.perf_counter() - start
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", float("nan")) if memory is not None else float("nan")
    state = {"params": params, "opt": opt_state}

    def run():
        state["params"], state["opt"], value = compiled(state["params"], state["opt"], tokens, targets)
        return value

    try:
        return _timing.timed(run, reps=reps, inner=2), temp, build
    finally:
        state.clear()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="d 128, 2 layers, seq 64, batch 2, vocab 512 (CPU smoke)")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no GPU")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--attention", nargs="+", default=["cudnn", "xla"], choices=["cudnn", "xla"])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    if jax.default_backend() == "cpu" and not args.allow_cpu:
        sys.exit("no GPU: pass --allow-cpu (with --small) for a smoke test")
    if args.small:
        args.d_model, args.layers, args.seq, args.batch, args.vocab = 128, 2, 64, 2, 512
    heads = max(1, args.d_model // 128)
    cfg = L.Config(
        vocab=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=heads,
        n_kv_heads=max(1, heads // 2),
        d_ff=4 * args.d_model,
        max_len=args.seq,
        dtype=jnp.bfloat16,
    )
    t = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, args.vocab)
    tokens, targets = t[:, :-1], t[:, 1:]
    print(_timing.header(f"invariant_bench: {cfg}") + "\n")
    print(
        "| user attention | plain step (ms) | invariant step (ms) | time ratio | temp memory ratio "
        "| trace+compile (s): plain / invariant | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for impl in args.attention:
        c = dataclasses.replace(cfg, attention=impl)
        plain = guard(measure, c, False, tokens, targets, args.reps)
        inv = guard(measure, c, True, tokens, targets, args.reps)
        if failed(plain) or failed(inv):
            print(
                f"| {impl} | {plain if failed(plain) else f'{plain[0] * 1e3:.1f}'} | "
                f"{inv if failed(inv) else f'{inv[0] * 1e3:.1f}'} | - | - | - | - |",
                flush=True,
            )
            continue
        print(
            f"| {impl} | {plain[0] * 1e3:.1f} | {inv[0] * 1e3:.1f} | {inv[0] / plain[0]:.3f} | "
            f"{inv[1] / plain[1]:.3f} | {plain[2]:.1f} / {inv[2]:.1f} | {inv[2] / plain[2]:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
