"""The contracts of jaxdet.invariant as check functions (docs/invariant.md), on the plain-JAX
Llama-style model (jaxdet.models.plain_llama) at a small size.

The report calls them with their defaults; tests/test_invariant.py proves the same contracts with
more shapes, dtypes and devices. Each returns (ok, detail).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

import jaxdet
from jaxdet._src.core.testing import same_bits
from jaxdet.models import plain_llama as L


def _model(dtype):
    cfg = L.Config(dtype=dtype)
    return cfg, L.init(cfg, jax.random.key(0))


def _batch(cfg, B, T, seed=1):
    t = jax.random.randint(jax.random.key(seed), (B, T + 1), 0, cfg.vocab)
    return t[:, :-1], t[:, 1:]


def check_rows(dtype=jnp.bfloat16, batch=8, seq=16):
    """A sequence's log-probs alone == inside the batch, and in a permuted batch."""
    cfg, params = _model(dtype)
    tokens, targets = _batch(cfg, batch, seq)
    lp = jax.jit(jaxdet.invariant(functools.partial(L.log_probs, cfg)))
    full = lp(params, tokens, targets)
    alone = lp(params, tokens[3:4], targets[3:4])
    perm = jnp.arange(batch)[::-1]
    ok = same_bits(alone, full[3:4]) and same_bits(lp(params, tokens[perm], targets[perm]), full[perm])
    return ok, f"{jnp.dtype(dtype).name} log-probs, batch {batch} x {seq}: row alone and permuted " + (
        "bitwise equal" if ok else "DIFFER"
    )


def check_decode(dtype=jnp.bfloat16, batch=3, seq=8):
    """The decode loop over a masked full-length KV cache == the one-pass forward."""
    cfg, params = _model(dtype)
    tokens, _ = _batch(cfg, batch, seq, seed=2)
    logits = jax.jit(jaxdet.invariant(functools.partial(L.forward, cfg)))(params, tokens)
    step = jax.jit(jaxdet.invariant(functools.partial(L.decode_step, cfg)))
    cache = L.init_cache(cfg, batch)
    bad = []
    for t in range(seq):
        out, cache = step(params, cache, tokens[:, t], t)
        if not same_bits(out, logits[:, t]):
            bad.append(t)
    ok = not bad
    return ok, f"{jnp.dtype(dtype).name} decode over a {cfg.max_len}-position masked cache vs prefill: " + (
        "bitwise equal at every step" if ok else f"DIFFER at steps {bad}"
    )


def check_gradient_orders(dtype=jnp.float32):
    """jax.grad(invariant(loss)) == invariant(jax.grad(loss)), bitwise."""
    cfg, params = _model(dtype)
    tokens, targets = _batch(cfg, 4, 12, seed=3)
    loss = functools.partial(L.loss, cfg=cfg)
    a = jax.jit(jax.grad(jaxdet.invariant(loss)))(params, tokens, targets)
    b = jax.jit(jaxdet.invariant(jax.grad(loss)))(params, tokens, targets)
    ok = all(same_bits(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    return ok, f"{jnp.dtype(dtype).name} grad(invariant(loss)) vs invariant(grad(loss)): " + (
        "bitwise equal" if ok else "DIFFER"
    )


def report_checks():
    return [
        ("invariant: a model's rows alone == in a batch (bf16)", check_rows),
        ("invariant: decode over a masked cache == prefill (bf16)", check_decode),
        ("invariant: grad of invariant == invariant of grad (f32)", check_gradient_orders),
    ]
