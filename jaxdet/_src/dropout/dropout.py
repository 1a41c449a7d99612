"""Deterministic inverted dropout keyed by (Philox key, global element index).

The contract (docs/dropout.md, proven by tests/test_dropout.py): element ``i`` of ``x`` (its
row-major index plus ``offset``, static or traced; 64-bit) is kept iff word ``g % 4`` of
``philox4x32_10([lo32(g // 4), hi32(g // 4), 0, 0], key)`` is ``>= round(rate * 2**32)``, with
``g = i + offset``. A kept element becomes ``dtype(float32(x) * float32(1 / (1 - rate)))``, a dropped
one ``+0``. Nothing else (dtype, shape, launch grid, device, backend) enters the mask.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from jaxdet._src.core import autodiff, batching, ffi, tree, varying
from jaxdet._src.core.checks import (
    check_philox_key,
    check_static_float,
    check_static_int,
    float_dtype_of,
    is_traced,
)

__all__ = ["dropout", "drop_threshold", "keep_scale"]

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def drop_threshold(rate: float) -> int:
    """The integer rule: an element is dropped iff its Philox word < round(rate * 2**32)."""
    return min(int(round(rate * 2.0**32)), 2**32 - 1)


def keep_scale(rate: float) -> np.float32:
    """float32(1 / (1 - rate)), computed in float64 and rounded once."""
    return np.float32(1.0 / (1.0 - rate))


# ---- The primitive: x[*G, *S], keys uint32[*G, 2], offsets uint32[*G, 2] (the (lo32, hi32) words of
# each group's 64-bit offset); group g uses keys[g] and offsets[g] and indexes its own slice. ----


def _dropout_abstract_eval(x, keys, offsets, **params):
    return jax.core.ShapedArray(x.shape, x.dtype)


def _dropout_batch(args, dims, **params):
    # The vmapped axis becomes a new leading group axis: each example gets its key and offset (the
    # shared one, broadcast, when they are not batched), so each example's elements are indexed
    # from its own offset exactly as in an unbatched call.
    _, (x, keys, offsets) = batching.to_front(args, dims)
    return dropout_p.bind(x, keys, offsets, **params), 0


MAX_MASK_RUNS = 16  # kMaxMaskRank in cuda/common/philox.h


def _mask_strides(shape, broadcast_dims):
    """Each dimension's stride in the mask index: row-major in `shape` with the broadcast
    dimensions set to 1 (their stride is 0)."""
    strides, step = [0] * len(shape), 1
    for d in reversed(range(len(shape))):
        if d not in broadcast_dims:
            strides[d] = step
            step *= shape[d]
    return strides


def _runs(sizes, strides):
    """Merge neighbouring dimensions whose mask indices continue each other into runs of
    (size, stride); size-1 dimensions vanish. One run of stride 1 is the plain row-major index."""
    runs = []
    for n, st in zip(sizes, strides):
        if n == 1:
            continue
        if runs and runs[-1][1] == st * n:
            runs[-1] = [runs[-1][0] * n, st]
        else:
            runs.append([n, st])
    return runs


def _add64(words, add):
    """(lo32, hi32) uint32 pairs plus a uint32[2] pair, modulo 2**64."""
    lo = words[..., 0] + add[0]
    hi = words[..., 1] + add[1] + (lo < add[0]).astype(jnp.uint32)
    return jnp.stack([lo, hi], axis=-1)


def _words(value: int) -> np.ndarray:
    value %= 2**64
    return np.array([value & 0xFFFFFFFF, value >> 32], np.uint32)


def _shard_offset(x_shape, groups, strides, axes):
    """uint32[2]: sum over the split dimensions d of start_d * stride_d, the shard's first mask index.

    Each split dimension looks its term up in a small table by the shard's position along the mesh
    axes splitting it (``lax.axis_index``), so the 64-bit products are exact Python integers."""
    total = jnp.zeros((2,), jnp.uint32)
    for d, stride in enumerate(strides):
        names = axes.get(f"s{d}")
        if not names or stride == 0:
            continue
        count = math.prod(jax.lax.axis_size(n) for n in names)
        local = x_shape[groups + d] // count
        table = jnp.asarray(np.stack([_words(i * local * stride) for i in range(count)]))
        total = _add64(total[None], table[jax.lax.axis_index(names if len(names) > 1 else names[0])])[0]
    return total


def _dropout_local(params, axes, shapes):
    """The per-shard dropout: the global mask indices of this device's elements are its offset plus
    the shard's start (`_shard_offset`) plus the dot product of its local indices with the global
    mask strides, so every shard draws exactly the bits of the unsharded mask."""
    x_shape, key_shape, _ = shapes
    groups = len(key_shape) - 1
    strides = _mask_strides(x_shape[groups:], params["broadcast_dims"])
    attrs = dict(drop_threshold=params["drop_threshold"], scale=params["scale"])

    def run(x, keys, offsets):
        if axes:
            offsets = _add64(offsets, _shard_offset(x_shape, groups, strides, axes))
        runs = _runs(x.shape[groups:], strides)
        if len(runs) > MAX_MASK_RUNS:
            raise ValueError(
                f"jaxdet.dropout: this shard of x{list(x_shape)} splits into {len(runs)} runs of mask "
                f"indices, more than {MAX_MASK_RUNS}; reshape x or shard fewer of its dimensions"
            )
        if len(runs) <= 1 and all(st == 1 for _, st in runs):
            return dropout_p.shard.bind(x, keys, offsets, mask_strides=(), **attrs)
        sizes = tuple(n for n, _ in runs)
        out = dropout_p.shard.bind(
            x.reshape(x.shape[:groups] + sizes), keys, offsets, mask_strides=tuple(st for _, st in runs), **attrs
        )
        return out.reshape(x.shape)

    return run


def _dropout_factors(params, shapes):
    # Every dimension of x may be split (no collective: each shard draws its own part of the
    # global mask); keys and offsets follow x's group dimensions.
    x_shape, key_shape, _ = shapes
    groups = tuple(f"g{i}" for i in range(len(key_shape) - 1))
    x_factors = groups + tuple(f"s{i}" for i in range(len(x_shape) - len(groups)))
    return [x_factors, groups + ("key",), groups + ("offset",)], [x_factors]


dropout_p = ffi.define_primitive(
    "jaxdet_dropout",
    _dropout_abstract_eval,
    attributes=lambda drop_threshold, scale, mask_strides: dict(
        drop_threshold=np.uint32(drop_threshold),
        scale=np.float32(scale),
        mask_strides=np.asarray(mask_strides, np.int64),
    ),
    batching_rule=_dropout_batch,
    partitioning=ffi.Partitioning(_dropout_factors, replicated=frozenset({"key", "offset"}), local=_dropout_local),
)


# ---- Derivatives: dropout is linear in x (the mask is a function of the key, the offset and the
# element index), so its tangent is the same mask applied to the tangent and its transpose is the
# same mask applied to the cotangent: rules of the primitive itself, to any order, forward and
# reverse. Only the key and the offset (16 bytes) are kept for the backward; no mask is saved. ----


def _dropout_jvp(primals, tangents, **params):
    (x, key, offsets), tx = primals, tangents[0]
    out = dropout_p.bind(x, key, offsets, **params)
    if type(tx) is ad.Zero:
        return out, autodiff.zero_tangent(out)
    return out, dropout_p.bind(tx, key, offsets, **params)


def _dropout_transpose(g, x, key, offsets, **params):
    # Under shard_map, an x that is invariant over an axis its key or offset varies over gets the
    # canonical-tree sum of the devices' cotangents (float32, cast once).
    x_vma = varying.varying_axes(x.aval)
    if type(g) is ad.Zero:
        return [ad.Zero(x.aval), None, None]
    if varying.varying_union(g, key, offsets) - x_vma:
        dx = dropout_p.bind(g.astype(jnp.float32), key, offsets, **params)
        return [tree.match_varying(dx, x_vma).astype(g.dtype), None, None]
    return [tree.match_varying(dropout_p.bind(g, key, offsets, **params), x_vma), None, None]


ad.primitive_jvps[dropout_p] = _dropout_jvp
ad.primitive_transposes[dropout_p] = _dropout_transpose


def _offset_words(offset):
    """The offset as uint32[2] (lo32, hi32): a constant for a static int, else from a traced scalar."""
    if is_traced(offset) or isinstance(offset, jax.Array):
        value = jnp.asarray(offset)
        if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.integer) or value.dtype == jnp.bool_:
            raise TypeError(
                f"offset must be a Python int or an integer scalar array, got {value.dtype}{list(value.shape)}"
            )
        lo = value.astype(jnp.uint32)
        if jnp.iinfo(value.dtype).bits == 64:
            hi = (value >> 32).astype(jnp.uint32)
        elif jnp.issubdtype(value.dtype, jnp.signedinteger):
            hi = jnp.where(value < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))  # modulo 2**64, as documented
        else:
            hi = jnp.zeros((), jnp.uint32)
        return jnp.stack([lo, hi])
    offset = check_static_int(offset, "offset", minimum=0)
    if offset >= 2**63:
        raise ValueError(f"offset must be < 2**63, got {offset}")
    return jnp.asarray(_words(offset))


def dropout(x, key, rate, *, deterministic: bool = False, offset: int = 0, broadcast_dims=()):
    """Inverted dropout with a mask that is a pure function of (key, element index, rate).

    Args:
      x: float32, bfloat16 or float16 array.
      key: uint32[2] Philox key (``jaxdet.random.key``). May be None when nothing is dropped
        (``deterministic=True`` or ``rate == 0``).
      rate: drop probability, a Python float in [0, 1).
      deterministic: if True, return ``x`` unchanged.
      offset: added to every element's row-major index (64-bit), so that
        ``dropout(x, k, p).ravel()[a:b] == dropout(x.ravel()[a:b], k, p, offset=a)`` bitwise.
        A Python int in [0, 2**63), or a traced integer scalar (int32, uint32, int64 with x64;
        taken modulo 2**64) with exactly the static form's mask: a scanned micro-batch's
        ``i * size``, a shard_map device's ``lax.axis_index(axis) * x.size``.
      broadcast_dims: dimensions along which one mask value is shared (as in flax). Mask indices
        are then row-major indices in the shape with those dimensions set to 1.

    Under ``jax.vmap`` a batched key gives each example its own mask; an unbatched key (and
    offset) gives every example the same mask (each example is indexed from 0 + offset); a batched
    offset gives each example its own. Differentiable in x to any order, forward and reverse (it is
    linear in x): the tangent and the cotangent get the same mask, regenerated from the key and
    offset; no mask or input is saved.
    Under sharded ``jax.jit``, a sharded ``x`` draws the unsharded mask with no collective
    (docs/sharding.md).
    """
    float_dtype_of(x, "x")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a Python bool, got {type(deterministic).__name__}")
    rate = check_static_float(rate, "rate")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"rate must be in [0, 1), got {rate}")
    offsets = _offset_words(offset)
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
    if normalized and len(_runs(x.shape, _mask_strides(x.shape, set(normalized)))) > MAX_MASK_RUNS:
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
    params = (
        ("broadcast_dims", tuple(sorted(normalized))),
        ("drop_threshold", drop_threshold(rate)),
        ("scale", float(keep_scale(rate))),
    )
    return dropout_p.bind(x, key, offsets, **dict(params))


# `jaxdet.dropout` is the function (the package exports it), so the rule's constants are reachable
# from it: jaxdet.dropout.drop_threshold(rate), jaxdet.dropout.keep_scale(rate) (docs/dropout.md).
dropout.drop_threshold = drop_threshold
dropout.keep_scale = keep_scale
dropout.SUPPORTED_DTYPES = SUPPORTED_DTYPES
