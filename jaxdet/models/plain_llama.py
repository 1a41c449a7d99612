"""A Llama-style decoder in plain JAX, with no jaxdet call: what a user brings to
`jaxdet.invariant` (the `jnp.take` embedding, RMSNorm written in jnp, RoPE, grouped-query
attention through `jax.nn.dot_product_attention`, SwiGLU, an untied head, optax-style
cross-entropy), with a prefill forward and a decode step over a full-length masked KV cache (as
`nnx.MultiHeadAttention(decode=True)` keeps it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxdet.models.config import DecoderSizes


@dataclasses.dataclass(frozen=True)
class Config(DecoderSizes):
    n_kv_heads: int = 2
    attention: str = "xla"  # jax.nn.dot_product_attention's implementation ("xla" or "cudnn")

    def __post_init__(self):
        super().__post_init__()
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Config.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")


def init(cfg: Config, key):
    def dense(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / jnp.sqrt(shape[0])).astype(cfg.dtype)

    keys = iter(jax.random.split(key, 4 + 7 * cfg.n_layers))
    hd = cfg.head_dim
    layers = []
    for _ in range(cfg.n_layers):
        layers.append(
            {
                "attn_norm": jnp.ones((cfg.d_model,), cfg.dtype),
                "wq": dense(next(keys), (cfg.d_model, cfg.n_heads * hd)),
                "wk": dense(next(keys), (cfg.d_model, cfg.n_kv_heads * hd)),
                "wv": dense(next(keys), (cfg.d_model, cfg.n_kv_heads * hd)),
                "wo": dense(next(keys), (cfg.n_heads * hd, cfg.d_model)),
                "mlp_norm": jnp.ones((cfg.d_model,), cfg.dtype),
                "w_gate": dense(next(keys), (cfg.d_model, cfg.d_ff)),
                "w_up": dense(next(keys), (cfg.d_model, cfg.d_ff)),
                "w_down": dense(next(keys), (cfg.d_ff, cfg.d_model)),
            }
        )
    return {
        "embed": dense(next(keys), (cfg.vocab, cfg.d_model)),
        "layers": layers,
        "final_norm": jnp.ones((cfg.d_model,), cfg.dtype),
        "head": dense(next(keys), (cfg.d_model, cfg.vocab)),
    }


def rms_norm(x, scale, eps=1e-6):
    xf = x.astype(jnp.float32)
    var = jnp.mean(xf * xf, axis=-1, keepdims=True)
    return (xf * jax.lax.rsqrt(var + eps)).astype(x.dtype) * scale


def rope(x, positions, base=10000.0):
    """x [B, T, H, D], positions [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions[..., None].astype(jnp.float32) * inv  # [B, T, D/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _qkv(cfg, layer, h, positions):
    B, T, _ = h.shape
    hd = cfg.head_dim
    q = (h @ layer["wq"]).reshape(B, T, cfg.n_heads, hd)
    k = (h @ layer["wk"]).reshape(B, T, cfg.n_kv_heads, hd)
    v = (h @ layer["wv"]).reshape(B, T, cfg.n_kv_heads, hd)
    return rope(q, positions), rope(k, positions), v


def _mlp(layer, x):
    h = rms_norm(x, layer["mlp_norm"])
    return (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]


def embed(params, tokens):
    return jnp.take(params["embed"], tokens, axis=0)


def forward(cfg: Config, params, tokens, positions=None, embeddings=None):
    """Logits [B, T, vocab] of a causal forward over tokens [B, T] (or over their `embeddings`
    [B, T, d_model], for gradients with respect to the inputs)."""
    x = embed(params, tokens) if embeddings is None else embeddings
    B, T = x.shape[:2]
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    for layer in params["layers"]:
        q, k, v = _qkv(cfg, layer, rms_norm(x, layer["attn_norm"]), positions)
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention)
        x = x + a.reshape(B, T, -1) @ layer["wo"]
        x = x + _mlp(layer, x)
    return rms_norm(x, params["final_norm"]) @ params["head"]


def log_probs(cfg, params, tokens, targets, embeddings=None):
    """log p(targets) [B, T] in float32."""
    logits = forward(cfg, params, tokens, embeddings=embeddings).astype(jnp.float32)
    lp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


def loss(params, tokens, targets, cfg=Config()):
    return -jnp.mean(log_probs(cfg, params, tokens, targets))


def init_cache(cfg: Config, batch):
    shape = (batch, cfg.max_len, cfg.n_kv_heads, cfg.head_dim)
    return [{"k": jnp.zeros(shape, cfg.dtype), "v": jnp.zeros(shape, cfg.dtype)} for _ in range(cfg.n_layers)]


def decode_step(cfg: Config, params, cache, token, position):
    """One token per sequence (token [B], position a scalar): logits [B, vocab] and the new
    cache. Attention runs over the whole cache (max_len) with the positions past `position`
    masked, as a fixed-shape decode loop keeps it."""
    B = token.shape[0]
    x = jnp.take(params["embed"], token[:, None], axis=0)
    pos = jnp.full((B, 1), position)
    mask = (jnp.arange(cfg.max_len) <= position)[None, None, None, :]  # [1, 1, 1, S]
    new_cache = []
    for layer, c in zip(params["layers"], cache):
        q, k, v = _qkv(cfg, layer, rms_norm(x, layer["attn_norm"]), pos)
        ck = jax.lax.dynamic_update_slice(c["k"], k, (0, position, 0, 0))
        cv = jax.lax.dynamic_update_slice(c["v"], v, (0, position, 0, 0))
        new_cache.append({"k": ck, "v": cv})
        a = jax.nn.dot_product_attention(q, ck, cv, mask=mask, implementation=cfg.attention)
        x = x + a.reshape(B, 1, -1) @ layer["wo"]
        x = x + _mlp(layer, x)
    logits = rms_norm(x, params["final_norm"]) @ params["head"]
    return logits[:, 0], new_cache
