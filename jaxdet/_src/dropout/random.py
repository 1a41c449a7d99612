"""Threefry-free Philox4x32-10 keys and the raw block function.

A jaxdet key is a plain ``uint32[2]`` array (Philox's two key words), so it works under jit, vmap
and scan like any other array. Every derivation below is one Philox4x32-10 call made by the same
native code that dropout uses (docs/random.md has the exact layouts):

* ``key(seed)``         -> ``[seed mod 2^32, (seed >> 32) mod 2^32]`` (a 64-bit seed; negative seeds
                           are taken modulo 2^64).
* ``fold_in(key, d)``   -> words 0 and 1 of ``philox4x32_10([lo32(d), hi32(d), FOLD_TAG, 0], key)``.
* ``split(key, n)[i]``  == ``fold_in(key, i)``.
* ``from_jax_key(k)``   -> folds the jax key's data words, two at a time, into ``key(0)`` with
                           ``JAX_TAG`` in counter word 2 and the pair's position in word 3.

The dropout stream uses counters ``[lo32(b), hi32(b), 0, 0]``: a non-zero word 2 keeps key
derivation out of it.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import batching, ffi
from jaxdet._src.core.checks import check_philox_key, check_static_int, is_traced

FOLD_TAG = 0x464F4C44  # "FOLD"
JAX_TAG = 0x4A41584B  # "JAXK"

__all__ = ["key", "fold_in", "split", "from_jax_key", "philox4x32_10", "FOLD_TAG", "JAX_TAG"]


# ---- The primitive: counters uint32[*G, *S, 4], keys uint32[*G, 2] (one key per group). ----


def _philox_abstract_eval(counters, keys):
    return jax.core.ShapedArray(counters.shape, counters.dtype)


def _philox_batch(args, dims):
    counters, keys = args
    c_dim, k_dim = dims
    group_ndim = keys.ndim - 1
    if batching.not_mapped(k_dim):
        counters = jnp.moveaxis(counters, c_dim, group_ndim)
        return philox_p.bind(counters, keys), group_ndim
    size = keys.shape[k_dim]
    keys = jnp.moveaxis(keys, k_dim, 0)
    if batching.not_mapped(c_dim):
        counters = jnp.broadcast_to(counters, (size,) + counters.shape)
    else:
        counters = jnp.moveaxis(counters, c_dim, 0)
    return philox_p.bind(counters, keys), 0


def _philox_factors(params, shapes):
    # Elementwise over the blocks; a key's group dims are sharded like the counters' group dims.
    counters, keys = shapes
    groups = tuple(f"g{i}" for i in range(len(keys) - 1))
    blocks = groups + tuple(f"s{i}" for i in range(len(counters) - len(keys))) + ("words",)
    return [blocks, groups + ("key",)], [blocks]


philox_p = ffi.define_primitive(
    "jaxdet_philox4x32_10",
    _philox_abstract_eval,
    attributes=lambda: {},
    batching_rule=_philox_batch,
    partitioning=ffi.Partitioning(_philox_factors, replicated=frozenset({"words", "key"})),
)


def philox4x32_10(counter, key):
    """The Philox4x32-10 block function: uint32[..., 4] counters, a uint32[2] key -> uint32[..., 4].

    Bit-exact with Random123's ``philox4x32_R(10, ctr, key)`` (word i of the result is ``v[i]``).
    """
    key = check_philox_key(key)
    counter = jnp.asarray(counter)
    if counter.dtype != jnp.uint32 or counter.ndim < 1 or counter.shape[-1] != 4:
        raise TypeError(f"counter must be uint32[..., 4], got {counter.dtype}{list(counter.shape)}")
    if counter.size == 0:
        return counter
    return philox_p.bind(counter, key)


# ---- Keys. ----


def _split64(value, name: str):
    """(lo32, hi32) of an integer taken modulo 2^64, as uint32 scalars; traced ints allowed."""
    if is_traced(value) or isinstance(value, jax.Array):
        value = jnp.asarray(value)
        if not jnp.issubdtype(value.dtype, jnp.integer) or value.ndim != 0:
            raise TypeError(f"{name} must be an integer scalar, got {value.dtype}{list(value.shape)}")
        lo = value.astype(jnp.uint32)
        if jnp.issubdtype(value.dtype, jnp.signedinteger):
            if jnp.iinfo(value.dtype).bits == 64:
                hi = (value >> 32).astype(jnp.uint32)
            else:
                hi = jnp.where(value < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
        elif jnp.iinfo(value.dtype).bits == 64:
            hi = (value >> 32).astype(jnp.uint32)
        else:
            hi = jnp.uint32(0)
        return lo, hi
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = int(value)
    if not -(2**63) <= value < 2**64:
        raise ValueError(f"{name} must fit in 64 bits ([-2**63, 2**64)), got {value}")
    value %= 2**64
    return jnp.uint32(value & 0xFFFFFFFF), jnp.uint32(value >> 32)


def key(seed) -> jax.Array:
    """A uint32[2] Philox key from an integer seed: ``[seed mod 2^32, (seed >> 32) mod 2^32]``."""
    lo, hi = _split64(seed, "seed")
    return jnp.stack([lo, hi]).astype(jnp.uint32)


def fold_in(key, data) -> jax.Array:
    """A new key from `key` and an integer: words 0, 1 of philox([lo32(data), hi32(data), FOLD_TAG, 0], key)."""
    key = check_philox_key(key)
    lo, hi = _split64(data, "data")
    counter = jnp.stack([lo, hi, jnp.uint32(FOLD_TAG), jnp.uint32(0)]).astype(jnp.uint32)
    return philox_p.bind(counter, key)[:2]


def split(key, num: int = 2) -> jax.Array:
    """`num` keys as uint32[num, 2]; ``split(key, num)[i] == fold_in(key, i)``."""
    key = check_philox_key(key)
    num = check_static_int(num, "num", minimum=0)
    if num == 0:
        return jnp.zeros((0, 2), jnp.uint32)
    index = jnp.arange(num, dtype=jnp.uint32)
    counters = jnp.stack([index, jnp.zeros_like(index), jnp.full_like(index, FOLD_TAG), jnp.zeros_like(index)], axis=-1)
    return philox_p.bind(counters, key)[:, :2]


def from_jax_key(jax_key) -> jax.Array:
    """Convert a jax.random key (typed, or a raw uint32 key array) into a Philox key.

    The key's data words are folded two at a time into ``key(0)``: for pair j,
    ``k = philox([w[2j], w[2j+1], JAX_TAG, j], k)[:2]``. Leading (batch) dimensions are kept:
    a jax key array of shape S gives uint32[*S, 2].
    """
    dtype = getattr(jax_key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(jax_key)
    else:
        data = jnp.asarray(jax_key)
        if data.dtype != jnp.uint32 or data.ndim < 1:
            raise TypeError(
                "jax_key must be a jax.random key (jax.random.key(...)) or a raw uint32[..., W] key "
                f"(jax.random.PRNGKey(...)), got {data.dtype}{list(data.shape)}"
            )
    words = data.shape[-1]
    if words % 2:
        data = jnp.concatenate([data, jnp.zeros(data.shape[:-1] + (1,), jnp.uint32)], axis=-1)
    batch_shape = data.shape[:-1]
    flat = data.reshape((-1, data.shape[-1]))

    def convert_one(w):
        k = jnp.zeros((2,), jnp.uint32)
        for j in range(w.shape[0] // 2):
            counter = jnp.stack([w[2 * j], w[2 * j + 1], jnp.uint32(JAX_TAG), jnp.uint32(j)])
            k = philox_p.bind(counter, k)[:2]
        return k

    return jax.vmap(convert_one)(flat).reshape(batch_shape + (2,))
