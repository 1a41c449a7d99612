"""A stand-in for `jaxdet.models.llama` (the shared model protocol: `__call__` with `segment_ids`,
`init_cache`, `extend`) built from jaxdet ops, for the sampler's tests while the real model is
written. Learned position embeddings instead of RoPE; nothing else of Llama is needed here."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx, struct

import jaxdet


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 1
    n_kv_heads: int = 1
    d_ff: int = 128
    max_len: int = 64
    norm_eps: float = 1e-5
    dtype: object = jnp.float32
    modules: str = "jaxdet"


@struct.dataclass
class KVCache:
    k: list
    v: list


def _dense(rngs, fan_in, fan_out):
    return nnx.Param(jax.random.normal(rngs.params(), (fan_in, fan_out), jnp.float32) / fan_in**0.5)


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        d, hd = cfg.d_model, cfg.d_model // cfg.n_heads
        self.tok = nnx.Param(jax.random.normal(rngs.params(), (cfg.vocab_size, d)))
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.max_len, d)))
        self.layers = nnx.List(
            [
                nnx.Dict(
                    q=_dense(rngs, d, cfg.n_heads * hd),
                    k=_dense(rngs, d, cfg.n_kv_heads * hd),
                    v=_dense(rngs, d, cfg.n_kv_heads * hd),
                    o=_dense(rngs, cfg.n_heads * hd, d),
                    up=_dense(rngs, d, cfg.d_ff),
                    down=_dense(rngs, cfg.d_ff, d),
                    n1=nnx.Param(jnp.ones((d,))),
                    n2=nnx.Param(jnp.ones((d,))),
                )
                for _ in range(cfg.n_layers)
            ]
        )
        self.norm = nnx.Param(jnp.ones((d,)))
        self.head = _dense(rngs, d, cfg.vocab_size)

    def _blocks(self, tokens, positions, attend):
        cfg = self.cfg
        plain = cfg.modules == "flax"
        embed = (lambda t, i: jnp.take(t, i, axis=0)) if plain else jaxdet.embed
        matmul = jnp.matmul if plain else jaxdet.matmul
        norm = _plain_rms_norm if plain else jaxdet.rms_norm
        b, t = tokens.shape
        hd = cfg.d_model // cfg.n_heads
        pos = jnp.minimum(positions, cfg.max_len - 1)
        x = embed(self.tok[...], tokens) + embed(self.pos[...], pos)
        for i, layer in enumerate(self.layers):
            h = norm(x, layer["n1"][...], cfg.norm_eps)
            q = matmul(h, layer["q"][...]).reshape(b, t, cfg.n_heads, hd)
            k = matmul(h, layer["k"][...]).reshape(b, t, cfg.n_kv_heads, hd)
            v = matmul(h, layer["v"][...]).reshape(b, t, cfg.n_kv_heads, hd)
            out = attend(i, q, k, v)
            x = x + matmul(out.reshape(b, t, -1), layer["o"][...])
            h = norm(x, layer["n2"][...], cfg.norm_eps)
            x = x + matmul(jax.nn.gelu(matmul(h, layer["up"][...])), layer["down"][...])
        h = norm(x, self.norm[...], cfg.norm_eps)
        return matmul(h, self.head[...]).astype(jnp.float32)

    def __call__(self, tokens, positions=None, *, segment_ids=None):
        b, t = tokens.shape
        if segment_ids is not None:
            idx = jnp.arange(t)
            new = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
            positions = idx - jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
            if self.cfg.modules == "flax":
                same = segment_ids[:, :, None] == segment_ids[:, None, :]
                mask = same & (idx[:, None] >= idx[None, :])
                return self._blocks(tokens, positions, lambda i, q, k, v: _plain_attention(q, k, v, mask))
            return self._blocks(
                tokens, positions, lambda i, q, k, v: jaxdet.attention(q, k, v, segment_ids=segment_ids)
            )
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t), (b, t))
        if self.cfg.modules == "flax":
            return self._blocks(
                tokens, positions, lambda i, q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
            )
        return self._blocks(tokens, positions, lambda i, q, k, v: jaxdet.attention(q, k, v, q_positions=positions))

    def init_cache(self, batch, capacity):
        cfg = self.cfg
        shape = (batch, capacity, cfg.n_kv_heads, cfg.d_model // cfg.n_heads)
        return KVCache(
            k=[jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers)],
            v=[jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layers)],
        )

    def extend(self, tokens, positions, cache):
        b = tokens.shape[0]
        capacity = cache.k[0].shape[1]
        rows = jnp.arange(b)[:, None]
        new_k, new_v = list(cache.k), list(cache.v)

        def attend(i, q, k, v):
            new_k[i] = cache.k[i].at[rows, positions].set(k, mode="drop")
            new_v[i] = cache.v[i].at[rows, positions].set(v, mode="drop")
            if self.cfg.modules == "flax":
                mask = positions[:, :, None] >= jnp.arange(capacity)[None, None, :]
                return _plain_attention(q, new_k[i], new_v[i], mask)
            lengths = jnp.full((b,), capacity, jnp.int32)
            return jaxdet.attention(q, new_k[i], new_v[i], q_positions=positions, kv_lengths=lengths)

        logits = self._blocks(tokens, positions, attend)
        return logits, KVCache(k=new_k, v=new_v)


def _plain_rms_norm(x, scale, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _plain_attention(q, k, v, mask):
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
