"""Which products and sums of the invariant train step cost the most? (docs/invariant.md, "Speed")

Collects every `dot_general` and `reduce_sum` of the plain-JAX Llama step's forward and backward
(benchmarks/invariant_bench.py's model), groups equal ones (shapes, dtypes, dimension numbers),
and times each group's operation alone: XLA's (`lax.dot_general`, `lax.reduce_sum`) against the
rule's (jaxdet's dot_general, `jaxdet.sum`'s primitive). Rows sorted by the total time lost.

    python tools/experiments/invariant_products_probe.py          # GPU, the benchmark's model
    python tools/experiments/invariant_products_probe.py --small  # CPU smoke
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import _timing  # noqa: E402
import invariant_cost_probe  # noqa: E402  (beside this file)

from jaxdet._src.core import jaxprs  # noqa: E402
from jaxdet._src.matmul.dot_general import dot_general  # noqa: E402
from jaxdet._src.reduce.reduce import reduce_sum  # noqa: E402
from jaxdet.models import plain_llama as L  # noqa: E402


def collect(jaxpr, found):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in ("dot_general", "reduce_sum") and jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating):
            avals = tuple((tuple(v.aval.shape), str(v.aval.dtype)) for v in eqn.invars)
            if name == "dot_general":
                key = (name, avals, str(eqn.params["dimension_numbers"]), str(eqn.params["preferred_element_type"]))
            else:
                key = (name, avals, tuple(eqn.params["axes"]), str(eqn.outvars[0].aval.dtype))
            found[key] += 1
        for sub in jaxprs.sub_jaxprs(eqn.params):
            collect(sub, found)


def time_pair(key, reps):
    name, avals, *rest = key
    args = [jnp.asarray(np.random.default_rng(0).standard_normal(s), d) for s, d in avals]
    if name == "dot_general":
        dn = eval(rest[0])  # noqa: S307 - our own repr of a tuple of tuples
        pref = None if rest[1] == "None" else jnp.dtype(rest[1])
        xla = jax.jit(lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=pref))
        rule = jax.jit(lambda a, b: dot_general(a, b, dn, preferred_element_type=pref))
    else:
        axes, out = rest[0], np.dtype(rest[1])
        xla = jax.jit(lambda x: lax.reduce_sum_p.bind(x, axes=axes, out_sharding=None).astype(out))
        rule = jax.jit(lambda x: reduce_sum(x, axes, out))
    return _timing.timed(lambda: xla(*args), reps=reps), _timing.timed(lambda: rule(*args), reps=reps)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    cfg, B, T = invariant_cost_probe.bench_model(args.small, "xla" if jax.default_backend() == "cpu" else "cudnn")
    params = L.init(cfg, jax.random.key(0))
    tokens = jnp.zeros((B, T), jnp.int32)
    closed = jax.make_jaxpr(jax.value_and_grad(functools.partial(L.loss, cfg=cfg)))(params, tokens, tokens)
    found = collections.Counter()
    collect(closed.jaxpr, found)
    rows = []
    for key, n in found.items():
        try:
            xla, rule = time_pair(key, args.reps)
            rows.append((n * (rule - xla), n, key, xla, rule))
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            print(f"{key}: {type(e).__name__}: {str(e)[:100]}")
    print(f"{jax.devices()[0].device_kind}: {sum(found.values())} operations in {len(found)} groups")
    print(
        "| op | shapes | dims | count | XLA (us) | rule (us) | ratio | total lost (ms) |\n"
        "|---|---|---|---:|---:|---:|---:|---:|"
    )
    for lost, n, key, xla, rule in sorted(rows, key=lambda r: -r[0]):
        shapes = " x ".join(f"{list(s)}{d}" for s, d in key[1])
        print(
            f"| {key[0]} | {shapes} | {key[2]} | {n} | {xla * 1e6:.0f} | {rule * 1e6:.0f} | "
            f"{rule / xla:.2f} | {lost * 1e3:.2f} |"
        )


if __name__ == "__main__":
    main()
