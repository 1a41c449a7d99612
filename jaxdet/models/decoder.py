"""A reference GPT-style decoder built from jaxdet ops only (docs/reference_decoder.md).

Every operation that adds floats in an order is a jaxdet op: the dense layers, the token and
position embeddings (``jaxdet.embed``: a row gather whose table gradient is ``jaxdet.segment_sum``,
dB's chunk rule, instead of XLA's scatter-add), causal attention
(``jaxdet.attention``), ``jaxdet.rms_norm`` and the per-token ``jaxdet.softmax_cross_entropy``.
What is left is elementwise (residual adds, GELU) or data movement (reshapes, cache updates). So a
sequence's per-token log-probs and its rows of the input gradient have the same bits alone and
inside any batch, and the token-by-token decode loop over a KV cache (``init_cache``, ``extend``,
``decode_log_probs``) gives the training forward's log-probs bit for bit
(tests/test_reference_decoder.py); ``jaxdet.audit`` finds nothing in it. There are no biases: a
bias gradient is a sum over tokens in XLA's order.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet
from jaxdet.models.config import DecoderSizes

__all__ = [
    "DecoderConfig",
    "init",
    "embed",
    "block_forward",
    "forward",
    "logits",
    "token_losses",
    "token_log_probs",
    "init_cache",
    "extend",
    "decode_log_probs",
]


@dataclasses.dataclass(frozen=True)
class DecoderConfig(DecoderSizes):
    vocab: int = 512
    d_model: int = 256
    d_ff: int = 1024
    max_len: int = 64
    eps: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.head_dim not in jaxdet.attention.SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"DecoderConfig.d_model // n_heads ({self.head_dim}) must be a head dimension that "
                f"jaxdet.attention supports: {jaxdet.attention.SUPPORTED_HEAD_DIMS}"
            )
        if jnp.dtype(self.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            raise ValueError(f"DecoderConfig.dtype must be float32, bfloat16 or float16, got {self.dtype}")


def init(key, cfg: DecoderConfig) -> dict:
    """Parameters: normal(0, 1/sqrt(fan_in)) weights, unit norm scales, in ``cfg.dtype``."""
    keys = iter(jax.random.split(key, 4 + 4 * cfg.n_layers))

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
    for _ in range(cfg.n_layers):
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
    values = _concrete(tokens)
    if values is not None and values.size:
        bad = np.argwhere((values < 0) | (values >= cfg.vocab))
        if bad.size:
            at = tuple(int(i) for i in bad[0])
            raise ValueError(
                f"tokens must be in [0, vocab={cfg.vocab}), got {int(values[at])} at {list(at)} "
                f"({len(bad)} token(s) out of the vocabulary)"
            )


def _concrete(x):
    """x as a NumPy array when its values are known now (not traced under jit, vmap, scan...), else
    None. Traced values cannot be checked without jax.experimental.checkify: out-of-range tokens or
    positions then embed as jaxdet.embed does (jnp.take: a negative one counts from the end, others
    give NaN rows) and a cache write past the capacity is clamped by dynamic_update_slice -- callers
    that trace these must keep them in range."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def embed(params, tokens, cfg: DecoderConfig):
    """Token plus position embeddings ``[batch, seq, d_model]``: the tables' rows (``jaxdet.embed``;
    the same bits as a one-hot row times the table through ``jaxdet.matmul``)."""
    _check_tokens(tokens, cfg)
    # Positions are looked up per token too (not one [seq, d_model] block broadcast over the
    # batch, whose gradient would be a sum over the batch in XLA's order).
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return _embeddings(params, tokens, positions)


def _embeddings(params, tokens, positions):
    return jaxdet.embed(params["tok"], tokens) + jaxdet.embed(params["pos"], positions)


def _qkv(x, block, cfg):
    b, s, _ = x.shape
    qkv = jaxdet.matmul(x, block["qkv"]).reshape(b, s, 3, cfg.n_heads, cfg.head_dim)
    return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # [b, s, heads, dh]


def _attention_out(out, block):
    b, s, h, dh = out.shape
    return jaxdet.matmul(out.reshape(b, s, h * dh), block["proj"])


def _mlp(x, block):
    return jaxdet.matmul(jax.nn.gelu(jaxdet.matmul(x, block["up"])), block["down"])


def block_forward(x, block, cfg: DecoderConfig):
    """One pre-norm transformer block (causal attention, then the MLP) on ``[batch, seq, d_model]``."""
    q, k, v = _qkv(jaxdet.rms_norm(x, block["norm1"], cfg.eps), block, cfg)
    x = x + _attention_out(jaxdet.attention(q, k, v), block)
    return x + _mlp(jaxdet.rms_norm(x, block["norm2"], cfg.eps), block)


def forward(params, x, cfg: DecoderConfig, *, remat: bool = False):
    """Pre-norm transformer blocks over embeddings ``x`` ``[batch, seq, d_model]``; returns the
    final hidden states (normalized), ``[batch, seq, d_model]``. ``remat``: each block under
    ``jax.checkpoint`` (its activations recomputed in the backward; the same bits)."""
    step = jax.checkpoint(block_forward, static_argnums=2) if remat else block_forward
    for block in params["blocks"]:
        x = step(x, block, cfg)
    return jaxdet.rms_norm(x, params["norm"], cfg.eps)


def logits(params, tokens, cfg: DecoderConfig):
    """Next-token logits ``[batch, seq, vocab]`` (float32)."""
    hidden = forward(params, embed(params, tokens, cfg), cfg)
    return jaxdet.matmul(hidden, params["out"], preferred_element_type=jnp.float32)


def token_losses(params, x, targets, cfg: DecoderConfig, *, remat: bool = False):
    """Per-token cross-entropy ``[batch, seq]`` of ``targets`` given embeddings ``x`` (differentiable
    in ``x``: the input gradient whose rows the tests compare); ``remat`` as in ``forward``."""
    hidden = forward(params, x, cfg, remat=remat)
    out = jaxdet.matmul(hidden, params["out"], preferred_element_type=jnp.float32)
    return jaxdet.softmax_cross_entropy(out, targets)


def token_log_probs(params, tokens, cfg: DecoderConfig):
    """``log p(tokens[:, t + 1] | tokens[:, :t + 1])`` for every position, ``[batch, seq - 1]``
    (float32): the per-token log-probs that RL's trainer and sampler must agree on."""
    _check_tokens(tokens, cfg)
    x = embed(params, tokens[:, :-1], cfg)
    return -token_losses(params, x, tokens[:, 1:], cfg)


# ---- Decoding with a KV cache. Every row of every op above is computed by the same jaxdet kernels
# whether the sequence is processed whole or a chunk at a time, and jaxdet.attention gives a query
# the same bits against the cache as in the causal pass, so the log-probs are those of training. ----


def init_cache(cfg: DecoderConfig, batch: int, capacity: int) -> list:
    """An empty KV cache: per layer ``(k, v)``, each ``[batch, capacity, n_heads, head_dim]``
    in ``cfg.dtype``. Positions at or past a sequence's length are never read."""
    shape = (batch, capacity, cfg.n_heads, cfg.head_dim)
    return [(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype)) for _ in range(cfg.n_layers)]


def _write(cache, new, start):
    """cache[b, start[b] + i] = new[b, i] for every sequence b."""
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, 0))(cache, new, start)


def extend(params, cache, tokens, start, cfg: DecoderConfig):
    """Runs ``tokens`` ``[batch, n]`` at positions ``start .. start + n - 1`` (``start``: int or
    int ``[batch]``, each sequence's length so far) against the cache, which holds positions
    ``0 .. start - 1``. Returns the next-token logits ``[batch, n, vocab]`` (float32) and the cache
    with the new positions written. ``n = 1`` is one decode step; a prompt can go in one call.

    Raises ValueError for tokens out of ``[0, vocab)``, positions past ``max_len`` or past the
    cache's capacity, when they are known (not traced: ``tokens``'s shape always is, ``start`` and
    the token values are when passed as concrete arrays or ints). Traced out-of-range values are
    not checked: keep them in range (``decode_log_probs`` checks its whole sequence up front)."""
    _check_tokens(tokens, cfg)
    b, n = tokens.shape
    capacity = cache[0][0].shape[1] if cache else None
    if capacity is not None and n > capacity:
        raise ValueError(f"extend: {n} tokens do not fit a KV cache of capacity {capacity}")
    first = _concrete(start)
    if first is not None:
        first = np.broadcast_to(first, (b,)).astype(np.int64)
        end = int(first.max(initial=0)) + n
        if (first < 0).any():
            raise ValueError(f"extend: start must be >= 0, got {first.tolist()}")
        if end > cfg.max_len:
            raise ValueError(
                f"extend: positions up to {end - 1} (start {first.tolist()} + {n} tokens) are past the "
                f"config's max_len={cfg.max_len} (the position table has rows 0 .. {cfg.max_len - 1})"
            )
        if capacity is not None and end > capacity:
            raise ValueError(
                f"extend: positions up to {end - 1} (start {first.tolist()} + {n} tokens) overflow the KV "
                f"cache of capacity {capacity}"
            )
    start = jnp.broadcast_to(jnp.asarray(start, jnp.int32), (b,))
    positions = start[:, None] + jnp.arange(n, dtype=jnp.int32)
    x = _embeddings(params, tokens, positions)
    new_cache = []
    for block, (k_cache, v_cache) in zip(params["blocks"], cache):
        q, k, v = _qkv(jaxdet.rms_norm(x, block["norm1"], cfg.eps), block, cfg)
        kc, vc = _write(k_cache, k, start), _write(v_cache, v, start)
        out = jaxdet.attention(q, kc, vc, q_positions=positions, kv_lengths=start + n)
        x = x + _attention_out(out, block)
        x = x + _mlp(jaxdet.rms_norm(x, block["norm2"], cfg.eps), block)
        new_cache.append((kc, vc))
    hidden = jaxdet.rms_norm(x, params["norm"], cfg.eps)
    return jaxdet.matmul(hidden, params["out"], preferred_element_type=jnp.float32), new_cache


def decode_log_probs(params, tokens, cfg: DecoderConfig, *, prompt: int = 1, capacity: int | None = None):
    """``token_log_probs`` computed the way a sampler does: the first ``prompt`` tokens in one
    ``extend`` call, then one token per step (a ``lax.scan``) against a KV cache of ``capacity``
    positions (default: the sequence length). Bitwise equal to ``token_log_probs``."""
    _check_tokens(tokens, cfg)
    b, s = tokens.shape
    if not 1 <= prompt < s:
        raise ValueError(f"prompt must be in [1, {s - 1}] for {s} tokens, got {prompt}")
    capacity = s if capacity is None else capacity
    if capacity < s - 1:
        raise ValueError(f"capacity ({capacity}) must hold the {s - 1} positions that are run")
    cache = init_cache(cfg, b, capacity)
    logits, cache = extend(params, cache, tokens[:, :prompt], 0, cfg)
    first = jaxdet.softmax_cross_entropy(logits, tokens[:, 1 : prompt + 1])

    def step(cache, t):
        token = jax.lax.dynamic_slice_in_dim(tokens, t, 1, 1)
        logits, cache = extend(params, cache, token, t, cfg)
        target = jax.lax.dynamic_slice_in_dim(tokens, t + 1, 1, 1)
        return cache, jaxdet.softmax_cross_entropy(logits, target)[:, 0]

    _, rest = jax.lax.scan(step, cache, jnp.arange(prompt, s - 1))
    return -jnp.concatenate([first, jnp.moveaxis(rest, 0, 1)], axis=1)
