"""Contracts of jaxdet.attention (docs/attention.md), measured on the current default device for
`jaxdet report`; tests/test_attention.py runs the same checks. Each returns (ok, detail)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxdet
from jaxdet._src.core.testing import count_bit_differences


def _rand(shape, dtype=jnp.bfloat16, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def _qkv(B, T, N=8, K=2, D=64, dtype=jnp.bfloat16, seed=0):
    return _rand((B, T, N, D), dtype, seed), _rand((B, T, K, D), dtype, seed + 1), _rand((B, T, K, D), dtype, seed + 2)


def check_batch_invariance():
    q, k, v = _qkv(1, 96)
    f = jax.jit(lambda q, k, v: jaxdet.attention(q, k, v))
    alone = f(q, k, v)
    bad = 0
    for batch, at in ((4, 1), (16, 15)):
        big = [_rand((batch,) + x.shape[1:], x.dtype, 10 + i).at[at].set(x[0]) for i, x in enumerate((q, k, v))]
        bad += count_bit_differences(f(*big)[at : at + 1], alone)
    return bad == 0, f"a sequence alone vs inside batches of 4 and 16: {bad} output elements differ"


def check_decode_equals_prefill():
    T, cap = 600, 1200
    q, k, v = _qkv(1, T)
    full = jaxdet.attention(q, k, v)

    @jax.jit
    def decode(q, k, v):
        cache = jnp.full((1, cap) + k.shape[2:], jnp.nan, k.dtype)

        def step(carry, t):
            kc, vc = carry
            kc = lax.dynamic_update_slice_in_dim(kc, lax.dynamic_slice_in_dim(k, t, 1, 1), t, 1)
            vc = lax.dynamic_update_slice_in_dim(vc, lax.dynamic_slice_in_dim(v, t, 1, 1), t, 1)
            out = jaxdet.attention(
                lax.dynamic_slice_in_dim(q, t, 1, 1),
                kc,
                vc,
                q_positions=jnp.full((1, 1), t),
                kv_lengths=jnp.full((1,), t + 1),
            )
            return (kc, vc), out[:, 0]

        return jnp.moveaxis(lax.scan(step, (cache, cache), jnp.arange(T))[1], 0, 1)

    bad = count_bit_differences(decode(q, k, v), full)
    return bad == 0, f"{T} single-query decode steps (cache of {cap}) vs one causal pass: {bad} elements differ"


def check_chunked_prefill():
    T = 700
    q, k, v = _qkv(1, T)
    full = jaxdet.attention(q, k, v)
    bad = 0
    for a, b in ((0, 37), (37, 513), (513, 700)):
        out = jaxdet.attention(q[:, a:b], k[:, :b], v[:, :b], q_positions=jnp.arange(a, b)[None])
        bad += count_bit_differences(out, full[:, a:b])
    return bad == 0, f"chunks [0,37) [37,513) [513,700) vs one causal pass: {bad} elements differ"


def check_packed_segments():
    lengths = (50, 1, 77)
    T = sum(lengths)
    q, k, v = _qkv(1, T)
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None])
    packed = jaxdet.attention(q, k, v, segment_ids=seg)
    bad, start = 0, 0
    for n in lengths:
        sl = slice(start, start + n)
        bad += count_bit_differences(packed[:, sl], jaxdet.attention(q[:, sl], k[:, sl], v[:, sl]))
        start += n
    return bad == 0, f"3 packed sequences vs each alone: {bad} elements differ"


def check_gradient_rows():
    q, k, v = _qkv(1, 80)
    w = _rand(q.shape, jnp.float32, 5)

    @jax.jit
    def grads(q, k, v, w):
        return jax.grad(lambda q, k, v: jnp.sum(jaxdet.attention(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))(
            q, k, v
        )

    alone = grads(q, k, v, w)
    big = [_rand((8,) + x.shape[1:], x.dtype, 20 + i).at[5].set(x[0]) for i, x in enumerate((q, k, v, w))]
    bad = sum(count_bit_differences(g[5:6], a) for g, a in zip(grads(*big), alone))
    return bad == 0, f"dq, dk, dv of a sequence alone vs inside a batch of 8: {bad} elements differ"


def check_accuracy():
    q, k, v = _qkv(2, 200, dtype=jnp.float32)
    out = np.asarray(jaxdet.attention(q, k, v), np.float64)
    qd, kd, vd = (np.asarray(x, np.float64) for x in (q, k, v))
    kd, vd = np.repeat(kd, 4, 2), np.repeat(vd, 4, 2)
    s = np.einsum("btnd,bsnd->bnts", qd, kd) / math.sqrt(64)
    s = np.where(np.tril(np.ones((200, 200), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bnts,bsnd->btnd", p / p.sum(-1, keepdims=True), vd)
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    return err < 1e-5, f"float32 vs a float64 reference: relative error {err:.2e}"


def report_checks():
    return [
        ("attention: rows independent of the batch", check_batch_invariance),
        ("attention: decode steps == causal pass", check_decode_equals_prefill),
        ("attention: chunked prefill == causal pass", check_chunked_prefill),
        ("attention: packed segments == alone", check_packed_segments),
        ("attention: gradient rows independent of the batch", check_gradient_rows),
        ("attention: float32 accuracy", check_accuracy),
    ]
