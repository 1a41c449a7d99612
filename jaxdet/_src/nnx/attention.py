"""``dot_product_attention``: an ``attention_fn`` for ``nnx.MultiHeadAttention`` on ``jaxdet.attention``."""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax.nnx.nn import dtypes as flax_dtypes

import jaxdet

__all__ = ["dot_product_attention"]


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=None,
    dropout_rate=0.0,
    deterministic=False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=flax_dtypes.promote_dtype,
    is_causal=False,
):
    """``flax.nnx.dot_product_attention``'s signature on ``jaxdet.attention``.

    Pass it as ``nnx.MultiHeadAttention(..., attention_fn=jaxdet.nnx.dot_product_attention)``.
    ``query [batch..., T, N, D]``, ``key`` / ``value [batch..., S, K, D]`` with ``K`` dividing
    ``N`` (grouped-query attention), ``D`` in ``jaxdet.attention.SUPPORTED_HEAD_DIMS``. ``mask``
    (True = attend) broadcastable to ``[batch..., N, T, S]``, as nnx builds it: causal, padding,
    decode's full-length cache, or any combination; each query row's True entries must be one
    contiguous run of keys (jaxdet.attention's ``mask=``: a row of another form gives NaN,
    or a ValueError naming it when the mask is known at trace time). A query that sees no key gives
    zeros.
    ``is_causal`` adds the causal mask. A query row is computed by jaxdet.attention's canonical order
    from its first visible key, so a row's bits do not depend on the batch, padding or the cache's
    capacity: ``nnx.MultiHeadAttention`` in decode mode gives the prefill's bits.

    Not supported (each raises naming it): ``bias`` (an additive bias has no canonical form here),
    attention dropout (``dropout_rate > 0`` when not ``deterministic``), and ``module`` (sowing the
    attention weights: the fused kernel never forms them). ``precision`` is accepted: the scores and
    the weighted sum accumulate in float32 whatever it says.
    """
    if bias is not None:
        raise NotImplementedError(
            "jaxdet.nnx.dot_product_attention: an additive attention bias is not supported; express "
            "visibility as a boolean mask"
        )
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            f"jaxdet.nnx.dot_product_attention: attention dropout (dropout_rate={dropout_rate}) is not "
            "supported: the fused kernel never forms the attention weights to drop. Use dropout_rate=0.0, "
            "or deterministic=True"
        )
    if module is not None:
        raise NotImplementedError(
            "jaxdet.nnx.dot_product_attention: sow_weights=True (sowing the attention weights) is not "
            "supported: the fused kernel never forms them"
        )
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            "query, key and value must be [batch..., T, N, D], [batch..., S, K, D], [batch..., S, K, D] of one "
            f"rank, got query{list(query.shape)}, key{list(key.shape)}, value{list(value.shape)}"
        )
    batch = query.shape[:-3]
    if key.shape[:-3] != batch or value.shape[:-3] != batch:
        raise ValueError(
            f"query, key and value must share their batch dims, got query{list(query.shape)}, "
            f"key{list(key.shape)}, value{list(value.shape)}"
        )
    T, N, D = query.shape[-3:]
    S = key.shape[-3]
    B = math.prod(batch)
    q = query.reshape((B, T, N, D))
    k = key.reshape((B,) + key.shape[-3:])
    v = value.reshape((B,) + value.shape[-3:])
    mask4 = None
    if mask is not None:
        mask = jnp.asarray(mask, bool)
        expected = f"mask must be broadcastable to [batch..., N, T, S] = {list(batch) + [N, T, S]}"
        if mask.ndim > len(batch) + 3:
            raise ValueError(f"{expected}, got mask{list(mask.shape)}")
        heads = mask.shape[-3] if mask.ndim >= 3 else 1
        try:
            mask = jnp.broadcast_to(mask, batch + (heads if heads in (1, N) else N, T, S))
        except ValueError:
            raise ValueError(f"{expected}, got mask{list(mask.shape)}") from None
        mask4 = mask.reshape((B,) + mask.shape[-3:])
    out = jaxdet.attention(q, k, v, causal=bool(is_causal), q_positions=_causal_positions(is_causal, T, S), mask=mask4)
    return out.reshape(query.shape[:-1] + (value.shape[-1],))


def _causal_positions(is_causal, T, S):
    # nnx's is_causal is jax.nn.dot_product_attention's: query t sees keys 0 .. t (the mask's
    # top-left alignment), which is jaxdet.attention's causal with positions arange(T).
    return jnp.arange(T, dtype=jnp.int32) if is_causal and T != S else None
