"""A reference GPT-style decoder built from jaxdet ops only (docs/reference_decoder.md).

Every operation that adds floats in an order is a jaxdet op: the dense layers, the token and
position embeddings (one-hot rows through ``jaxdet.matmul``, so their gradients follow
``jaxdet.matmul_weight_grad``'s chunk contract instead of a scatter-add), causal attention
(``jaxdet.matmul`` for QKᵀ and PV with ``jaxdet.softmax``, until jaxdet's fused attention),
``jaxdet.rms_norm`` and the per-token ``jaxdet.softmax_cross_entropy``. What is left is
elementwise (residual adds, GELU, the causal mask, scaling) or data movement (reshapes,
transposes). So a sequence's per-token log-probs and its rows of the input gradient have the same
bits alone and inside any batch (tests/test_reference_decoder.py), and ``jaxdet.audit`` finds
nothing in it. There are no biases: a bias gradient is a sum over tokens in XLA's order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

import jaxdet

__all__ = ["DecoderConfig", "init", "embed", "forward", "logits", "token_losses", "token_log_probs"]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 512
    d_model: int = 256
    heads: int = 4
    layers: int = 2
    d_ff: int = 1024
    max_len: int = 64
    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        for name in ("vocab", "d_model", "heads", "layers", "d_ff", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"DecoderConfig.d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        if jnp.dtype(self.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ValueError(f"DecoderConfig.dtype must be float32, bfloat16 or float16, got {self.dtype}")


def init(key, cfg: DecoderConfig) -> dict:
    """Parameters: normal(0, 1/sqrt(fan_in)) weights, unit norm scales, in ``cfg.dtype``."""
    keys = iter(jax.random.split(key, 4 + 4 * cfg.layers))

    def dense(k, fan_in, fan_out):
        return (jax.random.normal(k, (fan_in, fan_out), jnp.float32) / math.sqrt(fan_in)).astype(cfg.dtype)

    ones = jnp.ones((cfg.d_model,), cfg.dtype)
    params = {
        "tok": dense(next(keys), cfg.vocab, cfg.d_model) * math.sqrt(cfg.vocab),
        "pos": dense(next(keys), cfg.max_len, cfg.d_model) * math.sqrt(cfg.max_len),
        "out": dense(next(keys), cfg.d_model, cfg.vocab),
        "norm": ones,
        "blocks": [],
    }
    for _ in range(cfg.layers):
        params["blocks"].append(
            {
                "norm1": ones,
                "qkv": dense(next(keys), cfg.d_model, 3 * cfg.d_model),
                "proj": dense(next(keys), cfg.d_model, cfg.d_model),
                "norm2": ones,
                "up": dense(next(keys), cfg.d_model, cfg.d_ff),
                "down": dense(next(keys), cfg.d_ff, cfg.d_model),
            }
        )
    return params


def _check_tokens(tokens, cfg):
    if not hasattr(tokens, "shape") or len(tokens.shape) != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(
            f"tokens must be an integer array [batch, seq], got {getattr(tokens, 'dtype', type(tokens))}"
            f"{list(getattr(tokens, 'shape', []))}"
        )
    if tokens.shape[1] > cfg.max_len:
        raise ValueError(f"tokens has {tokens.shape[1]} positions but the config allows max_len={cfg.max_len}")


def embed(params, tokens, cfg: DecoderConfig):
    """Token plus position embeddings ``[batch, seq, d_model]``: each is a one-hot row times its table
    through ``jaxdet.matmul`` (one nonzero product per output, so the rows are the table's rows)."""
    _check_tokens(tokens, cfg)
    # Positions are one-hot per row too (not one [seq, d_model] block broadcast over the batch,
    # whose gradient would be a sum over the batch in XLA's order).
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    tok = jaxdet.matmul(jax.nn.one_hot(tokens, cfg.vocab, dtype=cfg.dtype), params["tok"])
    pos = jaxdet.matmul(jax.nn.one_hot(positions, cfg.max_len, dtype=cfg.dtype), params["pos"])
    return tok + pos


def _attention(x, block, cfg):
    b, s, d = x.shape
    h, dh = cfg.heads, d // cfg.heads
    qkv = jaxdet.matmul(x, block["qkv"]).reshape(b, s, 3, h, dh)
    q, k, v = (jnp.transpose(qkv[:, :, i], (0, 2, 1, 3)) for i in range(3))  # [b, h, s, dh]
    scores = jaxdet.matmul(q, jnp.swapaxes(k, -1, -2), preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(1.0 / math.sqrt(dh))
    causal = jnp.tril(jnp.ones((s, s), jnp.bool_))
    probs = jaxdet.softmax(jnp.where(causal, scores, -jnp.inf)).astype(x.dtype)
    out = jaxdet.matmul(probs, v)  # masked keys have probability +0, so they add +0
    out = jnp.transpose(out, (0, 2, 1, 3)).reshape(b, s, d)
    return jaxdet.matmul(out, block["proj"])


def _mlp(x, block):
    return jaxdet.matmul(jax.nn.gelu(jaxdet.matmul(x, block["up"])), block["down"])


def forward(params, x, cfg: DecoderConfig):
    """Pre-norm transformer blocks over embeddings ``x`` ``[batch, seq, d_model]``; returns the
    final hidden states (normalized), ``[batch, seq, d_model]``."""
    for block in params["blocks"]:
        x = x + _attention(jaxdet.rms_norm(x, block["norm1"], cfg.eps), block, cfg)
        x = x + _mlp(jaxdet.rms_norm(x, block["norm2"], cfg.eps), block)
    return jaxdet.rms_norm(x, params["norm"], cfg.eps)


def logits(params, tokens, cfg: DecoderConfig):
    """Next-token logits ``[batch, seq, vocab]`` (float32)."""
    hidden = forward(params, embed(params, tokens, cfg), cfg)
    return jaxdet.matmul(hidden, params["out"], preferred_element_type=jnp.float32)


def token_losses(params, x, targets, cfg: DecoderConfig):
    """Per-token cross-entropy ``[batch, seq]`` of ``targets`` given embeddings ``x`` (differentiable
    in ``x``: the input gradient whose rows the tests compare)."""
    hidden = forward(params, x, cfg)
    out = jaxdet.matmul(hidden, params["out"], preferred_element_type=jnp.float32)
    return jaxdet.softmax_cross_entropy(out, targets)


def token_log_probs(params, tokens, cfg: DecoderConfig):
    """``log p(tokens[:, t + 1] | tokens[:, :t + 1])`` for every position, ``[batch, seq - 1]``
    (float32): the per-token log-probs that RL's trainer and sampler must agree on."""
    _check_tokens(tokens, cfg)
    x = embed(params, tokens[:, :-1], cfg)
    return -token_losses(params, x, tokens[:, 1:], cfg)
