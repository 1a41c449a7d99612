"""Where does the GPU spend `jaxdet.invariant`'s train step? (docs/invariant.md, "Speed")

Profiles (jax.profiler) a few steps of benchmarks/invariant_bench.py's step, untransformed and
transformed, and sums the device time of each XLA operation (the "XLA Ops" lines of the GPU
plane) by its HLO name with the numbers removed, printing the largest and the differences.

    python tools/experiments/invariant_profile_probe.py [--attention cudnn] [--no-optimizer]
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp
import optax
from jax.profiler import ProfileData

import jaxdet
from jaxdet.models import plain_llama as L


def make(cfg, transformed, optimizer):
    tx = optax.adamw(1e-4)
    grad = jax.value_and_grad(
        jaxdet.invariant(functools.partial(L.loss, cfg=cfg)) if transformed else functools.partial(L.loss, cfg=cfg)
    )

    def step(params, opt_state, tokens, targets):
        value, grads = grad(params, tokens, targets)
        if not optimizer:
            return grads, opt_state, value
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return jax.jit(step, donate_argnums=(0, 1) if optimizer else ()), tx


def profile(cfg, transformed, optimizer, tokens, targets, steps=3):
    step, tx = make(cfg, transformed, optimizer)
    params = L.init(cfg, jax.random.key(0))
    state = [params, tx.init(params)]

    def run():
        p, o, v = step(state[0], state[1], tokens, targets)
        if optimizer:
            state[0], state[1] = p, o
        v.block_until_ready()

    run()
    run()
    d = tempfile.mkdtemp()
    with jax.profiler.trace(d):
        for _ in range(steps):
            run()
    data = ProfileData.from_file(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)[0])
    ops, kernels = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if "GPU" not in plane.name:
            continue
        for line in plane.lines:
            if line.name == "XLA Ops":
                target = ops
            elif line.name.startswith("Stream"):
                target = kernels
            else:
                continue
            for e in line.events:
                target[re.sub(r"[._]\d+", "", e.name)[:90]] += e.duration_ns / steps / 1e6
    if not ops and not kernels:
        print("no device events; planes:", [(pl.name, [ln.name for ln in pl.lines][:6]) for pl in data.planes])
    return ops or kernels


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attention", default="cudnn", choices=["cudnn", "xla"])
    p.add_argument("--no-optimizer", action="store_true")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    if jax.default_backend() != "gpu":
        sys.exit("needs a GPU")
    cfg = L.Config(
        vocab=32000,
        d_model=2048,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        d_ff=8192,
        max_len=2048,
        dtype=jnp.bfloat16,
        attention=args.attention,
    )
    t = jax.random.randint(jax.random.key(1), (4, 2049), 0, cfg.vocab)
    opt = not args.no_optimizer
    plain = profile(cfg, False, opt, t[:, :-1], t[:, 1:])
    inv = profile(cfg, True, opt, t[:, :-1], t[:, 1:])
    print(f"device time per step: plain {sum(plain.values()):.1f} ms, invariant {sum(inv.values()):.1f} ms")
    for name, ops in (("plain", plain), ("invariant", inv)):
        print(f"\n{name}: the largest operations (ms per step)")
        for op, ms in ops.most_common(args.top):
            print(f"  {ms:8.3f}  {op}")
    print("\ninvariant - plain, by operation name (ms per step)")
    diff = collections.Counter({k: inv.get(k, 0.0) - plain.get(k, 0.0) for k in set(inv) | set(plain)})
    for op, ms in diff.most_common(args.top):
        print(f"  {ms:+8.3f}  {op}")


if __name__ == "__main__":
    main()
