"""Deterministic inverted dropout keyed by (Philox key, global element index).

The contract (docs/dropout.md, proven by tests/test_dropout.py): element ``i`` of ``x`` (its
row-major index plus ``offset``; 64-bit) is kept iff word ``g % 4`` of
``philox4x32_10([lo32(g // 4), hi32(g // 4), 0, 0], key)`` is ``>= round(rate * 2**32)``, with
``g = i + offset``. A kept element becomes ``dtype(float32(x) * float32(1 / (1 - rate)))``, a dropped
one ``+0``. Nothing else (dtype, shape, launch grid, device, backend) enters the mask.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet import _ffi
from jaxdet._checks import check_philox_key, check_static_float, check_static_int

__all__ = ["dropout", "drop_threshold", "keep_scale"]

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def drop_threshold(rate: float) -> int:
    """The integer rule: an element is dropped iff its Philox word < round(rate * 2**32)."""
    return min(int(round(rate * 2.0**32)), 2**32 - 1)


def keep_scale(rate: float) -> np.float32:
    """float32(1 / (1 - rate)), computed in float64 and rounded once."""
    return np.float32(1.0 / (1.0 - rate))


# ---- The primitive: x[*G, *S], keys uint32[*G, 2]; group g uses keys[g] and indexes its own slice. ----

def _dropout_abstract_eval(x, keys, *, drop_threshold, offset, scale, mask_strides):
    return jax.core.ShapedArray(x.shape, x.dtype)


def _dropout_batch(args, dims, **params):
    x, keys = args
    x_dim, k_dim = dims
    group_ndim = keys.ndim - 1
    if _ffi.not_mapped(k_dim):
        # One key for every example: the batch axis becomes a group axis sharing that key, so each
        # example's elements are indexed from 0 (+ offset), exactly as in an unbatched call.
        x = jnp.moveaxis(x, x_dim, group_ndim)
        size = x.shape[group_ndim]
        keys = jnp.broadcast_to(keys[..., None, :], keys.shape[:-1] + (size, 2))
        return dropout_p.bind(x, keys, **params), group_ndim
    size = keys.shape[k_dim]
    keys = jnp.moveaxis(keys, k_dim, 0)
    if _ffi.not_mapped(x_dim):
        x = jnp.broadcast_to(x, (size,) + x.shape)
    else:
        x = jnp.moveaxis(x, x_dim, 0)
    return dropout_p.bind(x, keys, **params), 0


dropout_p = _ffi.define_primitive(
    "jaxdet_dropout",
    _dropout_abstract_eval,
    attributes=lambda drop_threshold, offset, scale, mask_strides: dict(
        drop_threshold=np.uint32(drop_threshold),
        offset=np.int64(offset),
        scale=np.float32(scale),
        mask_strides=np.asarray(mask_strides, np.int64),
    ),
    batching_rule=_dropout_batch,
)


MAX_MASK_RUNS = 16  # kMaxMaskRank in cuda/philox.h


def _mask_runs(shape, broadcast_dims):
    """Collapse x's dimensions into alternating runs of (size, mask stride); broadcast runs have
    stride 0. The mask index of an element is then the dot product of its run indices and strides."""
    mask_shape = [1 if d in broadcast_dims else n for d, n in enumerate(shape)]
    strides, step = [], 1
    for n in reversed(mask_shape):
        strides.append(step)
        step *= n
    strides.reverse()
    runs = []  # [size, stride, is_broadcast]
    for d, n in enumerate(shape):
        bcast = d in broadcast_dims
        if runs and runs[-1][2] == bcast:
            runs[-1][0] *= n
            runs[-1][1] = 0 if bcast else strides[d]
        else:
            runs.append([n, 0 if bcast else strides[d], bcast])
    return tuple(r[0] for r in runs), tuple(r[1] for r in runs)


def _apply(x, key, params, broadcast_dims):
    if not broadcast_dims:
        return dropout_p.bind(x, key, mask_strides=(), **dict(params))
    sizes, strides = _mask_runs(x.shape, broadcast_dims)
    out = dropout_p.bind(x.reshape(sizes), key, mask_strides=strides, **dict(params))
    return out.reshape(x.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _dropout(x, key, params, broadcast_dims):
    return _apply(x, key, params, broadcast_dims)


def _dropout_fwd(x, key, params, broadcast_dims):
    # The only residual is the 8-byte key: the backward regenerates the mask from (key, offset, rate).
    # (Calling the custom_vjp function, not the primitive, keeps higher-order derivatives working.)
    return _dropout(x, key, params, broadcast_dims), key


def _dropout_bwd(params, broadcast_dims, key, g):
    # Dropout is linear in x, so its transpose is itself: the same mask applied to the cotangent,
    # through the custom_vjp function again so that higher derivatives work.
    return _dropout(g, key, params, broadcast_dims), None


_dropout.defvjp(_dropout_fwd, _dropout_bwd)


def dropout(x, key, rate, *, deterministic: bool = False, offset: int = 0, broadcast_dims=()):
    """Inverted dropout with a mask that is a pure function of (key, element index, rate).

    Args:
      x: float32, bfloat16 or float16 array.
      key: uint32[2] Philox key (``jaxdet.random.key``). May be None when nothing is dropped
        (``deterministic=True`` or ``rate == 0``).
      rate: drop probability, a Python float in [0, 1).
      deterministic: if True, return ``x`` unchanged.
      offset: added to every element's row-major index (a Python int >= 0), so that
        ``dropout(x, k, p).ravel()[a:b] == dropout(x.ravel()[a:b], k, p, offset=a)`` bitwise.
      broadcast_dims: dimensions along which one mask value is shared (as in flax). Mask indices
        are then row-major indices in the shape with those dimensions set to 1.

    Under ``jax.vmap`` a batched key gives each example its own mask; an unbatched key gives every
    example the same mask (each example is indexed from 0 + offset). Reverse-mode only
    (``jax.custom_vjp``): the backward applies the same mask to the cotangent, regenerated from the
    key; no mask or input is saved.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        raise TypeError(f"x must be a JAX or NumPy array, got {type(x).__name__}")
    if not any(np.dtype(dtype) == np.dtype(d) for d in SUPPORTED_DTYPES):
        raise TypeError(f"x must be float32, bfloat16 or float16, got {np.dtype(dtype).name}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a Python bool, got {type(deterministic).__name__}")
    rate = check_static_float(rate, "rate")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"rate must be in [0, 1), got {rate}")
    offset = check_static_int(offset, "offset", minimum=0)
    if offset >= 2**63:
        raise ValueError(f"offset must be < 2**63, got {offset}")
    ndim = len(x.shape)
    try:
        dims = tuple(broadcast_dims)
    except TypeError:
        raise TypeError(f"broadcast_dims must be a sequence of ints, got {broadcast_dims!r}") from None
    normalized = []
    for d in dims:
        d = check_static_int(d, "broadcast_dims entry")
        if not -ndim <= d < ndim:
            raise ValueError(f"broadcast_dims entry {d} is out of range for x of rank {ndim}")
        normalized.append(d % ndim)
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"broadcast_dims has repeated dimensions: {dims}")
    if normalized and len(_mask_runs(tuple(x.shape), set(normalized))[0]) > MAX_MASK_RUNS:
        raise ValueError(
            f"broadcast_dims {dims} splits x's shape {tuple(x.shape)} into more than {MAX_MASK_RUNS} "
            "alternating broadcast/non-broadcast runs; reshape x first"
        )
    if deterministic or rate == 0.0:
        if key is not None:
            check_philox_key(key)
        return x
    key = check_philox_key(key)
    x = jnp.asarray(x)
    if x.size == 0:
        return x
    params = (("drop_threshold", drop_threshold(rate)), ("offset", offset), ("scale", float(keep_scale(rate))))
    return _dropout(x, key, params, frozenset(normalized))
