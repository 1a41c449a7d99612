"""The per-token arithmetic that the sampler and the trainer share: temperature scaling, the
log-prob of a token and the draw of a token from its row of logits (docs/sampling.md).

Every operation here is elementwise, data movement, an exact comparison or integer count, or a
jaxdet row kernel, so a row's result depends on that row (and its key and step) only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet.random
from jaxdet._src.core.checks import check_philox_key, is_traced

# Counter word 2 of the Philox block that draws a token: keeps the sampling stream apart from the
# dropout stream (word 2 = 0) and from key derivation (FOLD_TAG, JAX_TAG).
SAMPLE_TAG = 0x534D504C  # "SMPL"


def inverse_temperature(temperature) -> np.ndarray:
    """float32(1) / float32(temperature), computed once on the host (NumPy, IEEE division) so that
    the sampler and the trainer multiply the logits by the same bits; 1 for temperature 0 (greedy).
    `temperature` is a Python float or a concrete array of them, each >= 0 and finite."""
    if is_traced(temperature):
        raise TypeError(
            "temperature must be a Python float or a concrete array (the sampler and the trainer scale the "
            "logits by 1 / temperature computed on the host), got a traced value"
        )
    t = np.asarray(temperature, np.float32)
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {temperature!r}")
    return np.where(t == 0, np.float32(1), np.float32(1) / np.where(t == 0, np.float32(1), t)).astype(np.float32)


def scaled_logits(logits, inv_temperature):
    """logits * inv_temperature (one rounded float32 product per element; the product feeds
    jaxdet's row kernels directly, so no compiler can fuse it into an add)."""
    return logits.astype(jnp.float32) * inv_temperature


def token_log_probs(scaled, tokens):
    """log p(token) of each row of `scaled` logits: jaxdet.label_log_probs, float32."""
    return jaxdet.label_log_probs(scaled, tokens)


def uniform(key, step):
    """A float32 in [0, 1) for the draw at `step` (a uint32 scalar) of the request keyed `key`:
    the top 24 bits of word 0 of philox4x32_10([step, 0, SAMPLE_TAG, 0], key), times 2^-24."""
    counter = jnp.stack([step, jnp.uint32(0), jnp.uint32(SAMPLE_TAG), jnp.uint32(0)]).astype(jnp.uint32)
    bits = jaxdet.random.philox4x32_10(counter, key)[0]
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def draw(scaled, u):
    """The token of each row drawn by inverse CDF: the first index whose cumulative probability
    exceeds u times the row's total. p = jaxdet.softmax(scaled); the cumulative sums are a fixed
    tree of float32 adds over the vocabulary (lax.associative_scan), the same for every row; the
    index is an exact count. A draw at the top of the row (u * total rounding to the total) takes
    the last token of non-zero probability. scaled [B, V], u [B] -> int32 [B]."""
    p = jaxdet.softmax(scaled, axis=-1)
    cdf = jax.lax.associative_scan(jnp.add, p, axis=-1)
    threshold = u * cdf[:, -1]
    index = jnp.sum(cdf <= threshold[:, None], axis=-1, dtype=jnp.int32)
    vocab = p.shape[-1]
    last_nonzero = vocab - 1 - jnp.argmax(p[:, ::-1] > 0, axis=-1).astype(jnp.int32)
    return jnp.minimum(index, last_nonzero)


def select(scaled, logits, keys, steps, greedy):
    """The next token of each row: argmax of the logits where `greedy`, else a draw with the
    row's key at its step. logits, scaled [B, V]; keys uint32[B, 2]; steps uint32[B]; greedy
    bool[B] -> (tokens int32[B], log-probs float32[B] of those tokens under `scaled`)."""
    u = jax.vmap(uniform)(keys, steps)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1).astype(jnp.int32), draw(scaled, u))
    return tokens, token_log_probs(scaled, tokens)


def request_key(key, name="key"):
    """A request's Philox key as uint32[2] (a TypeError saying how to make one otherwise)."""
    return np.asarray(check_philox_key(jnp.asarray(key) if isinstance(key, np.ndarray) else key, name))
