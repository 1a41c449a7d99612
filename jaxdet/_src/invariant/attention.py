"""`jax.nn.dot_product_attention` inside `jaxdet.invariant`: jaxdet's fused attention where the
call has a form it has, else JAX's XLA implementation evaluated by the rules.

Which path a call takes depends only on what the call says (its arguments' shapes, dtypes and
which of them are given), never on values, so a prefill (`is_causal=True`) and a decode step
over a masked full-length cache (`mask=`) of the same model take the same path, and the fused
kernel gives them the same bits (docs/attention.md, "Masks"). The cuDNN call never stays in:
its order is cuDNN's own and changes with the shapes.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.attention.attention import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS
from jaxdet._src.attention.attention import attention as fused_attention

_PATCH_LOCK = threading.RLock()


def fused_form(query, key, value, bias, scale, return_residual):
    """Why the call cannot run on the fused kernel, or None when it can."""
    shapes = [getattr(x, "shape", None) for x in (query, key, value)]
    if any(s is None or len(s) not in (3, 4) for s in shapes) or len({len(s) for s in shapes}) != 1:
        return "query, key and value are not all [B, T, N, H] or all [T, N, H]"
    dtypes = {np.dtype(x.dtype) for x in (query, key, value)}
    if len(dtypes) != 1 or next(iter(dtypes)) not in {np.dtype(d) for d in SUPPORTED_DTYPES}:
        return f"dtypes {sorted(d.name for d in dtypes)}"
    if shapes[0][-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dimension {shapes[0][-1]} (the fused kernel has {SUPPORTED_HEAD_DIMS})"
    if bias is not None:
        return "a bias"
    if return_residual:
        return "return_residual=True"
    if scale is not None and isinstance(scale, jax.core.Tracer):
        return "a traced scale"
    return None


def _window_mask(T, S, local_window_size):
    left, right = local_window_size
    t = jnp.arange(T)[:, None]
    s = jnp.arange(S)[None, :]
    return (t <= s + left) & (t >= s - right)


def dot_product_attention(
    original,
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale=None,
    is_causal=False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size=None,
    implementation=None,
    return_residual=False,
):
    """`jax.nn.dot_product_attention`'s semantics on jaxdet.attention: `is_causal` (query t sees
    keys <= t), `mask`, `local_window_size` and `key_value_seq_lengths` ANDed into each query's
    run of keys; rows past `query_seq_lengths` are zeros, as JAX's own implementations give them.
    A query that sees no key gives zeros (JAX's XLA implementation gives the mean of the values
    there). Other forms run JAX's XLA implementation, whose products and sums follow the rules."""
    del implementation  # the cuDNN kernel never runs under the transformation
    if fused_form(query, key, value, bias, scale, return_residual) is not None:
        return original(
            query,
            key,
            value,
            bias,
            mask,
            scale=scale,
            is_causal=is_causal,
            query_seq_lengths=query_seq_lengths,
            key_value_seq_lengths=key_value_seq_lengths,
            local_window_size=local_window_size,
            implementation="xla",
            return_residual=return_residual,
        )
    rank3 = query.ndim == 3
    q, k, v = (x[None] if rank3 else x for x in (query, key, value))
    B, T = q.shape[:2]
    S = k.shape[1]
    window = None
    if local_window_size is not None:
        left, right = (local_window_size,) * 2 if isinstance(local_window_size, int) else local_window_size
        if is_causal and left >= 0 and right >= 0:  # keys t - left .. t: jaxdet.attention's window
            window = int(left) + 1
        else:
            visible = _window_mask(T, S, (left, right))
            mask = visible if mask is None else jnp.logical_and(mask, visible)
    kv_lengths = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    out = fused_attention(
        q,
        k,
        v,
        causal=bool(is_causal),
        scale=None if scale is None else float(scale),
        q_positions=jnp.arange(T, dtype=jnp.int32) if is_causal and T != S else None,
        kv_lengths=kv_lengths,
        mask=None if mask is None else jnp.asarray(mask),
        window=window,
    )
    if query_seq_lengths is not None:
        valid = jnp.arange(T)[None, :] < jnp.asarray(query_seq_lengths)[:, None]
        out = jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))
    return out[0] if rank3 else out


@contextlib.contextmanager
def on_jaxdet_kernels():
    """While a function is traced for the transformation, `jax.nn.dot_product_attention` is
    `dot_product_attention` above."""
    original = jax.nn.dot_product_attention

    @functools.wraps(original)
    def patched(*args, **kwargs):
        return dot_product_attention(original, *args, **kwargs)

    with _PATCH_LOCK:
        jax.nn.dot_product_attention = patched
        try:
            yield
        finally:
            jax.nn.dot_product_attention = original
