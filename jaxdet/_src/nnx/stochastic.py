"""``Dropout``: flax's module with ``jaxdet.dropout``'s mask, keyed from the ``nnx.Rngs`` stream."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.nnx import rnglib
from flax.nnx.module import first_from

import jaxdet

__all__ = ["Dropout"]


def _element_offset(example_offset, per_example):
    """example_offset examples of per_example mask elements each, as jaxdet.dropout's offset."""
    if isinstance(example_offset, (bool, np.bool_)):
        raise TypeError("example_offset must be an int or an integer scalar array, got a bool")
    if isinstance(example_offset, (int, np.integer)):
        if example_offset < 0:
            raise ValueError(f"example_offset must be >= 0 (the index of the first example), got {example_offset}")
        return int(example_offset) * per_example
    value = jnp.asarray(example_offset)
    if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(
            f"example_offset must be an int or an integer scalar array, got {value.dtype}{list(value.shape)}"
        )
    # A traced 32-bit index is widened to uint32 before the multiply: element offsets up to 2**32
    # (int64 under jax_enable_x64 for more), never a negative int32 product.
    if value.dtype.itemsize < 8:
        value = value.astype(jnp.uint32)
    return value * jnp.asarray(per_example, value.dtype)


class Dropout(nnx.Dropout):
    """``flax.nnx.Dropout`` with jaxdet's mask: the same constructor (``rate``, ``broadcast_dims``,
    ``deterministic``, ``rng_collection``, ``rngs``), ``nnx.view`` / ``train()`` / ``eval()``, and
    the same key handling: each call draws one key from the ``rng_collection`` stream (or uses the
    ``rngs`` given to the call: ``nnx.Rngs``, an ``RngStream`` or a jax key).

    The key becomes a Philox key by ``jaxdet.random.from_jax_key``, and the mask is
    ``jaxdet.dropout``'s: a pure function of (key, element index, rate) (docs/dropout.md), the same
    on CPU and GPU. ``example_offset`` (a Python int or a traced integer scalar) is the index of the
    input's first example (axis 0) in the whole batch: a micro-batch, a device's shard or a single
    sequence given its index then draws exactly its rows of the whole batch's mask (a traced 32-bit
    offset reaches 2**32 mask elements; int64 under ``jax_enable_x64`` beyond). Rate 1.0 gives
    zeros (as flax); rate 0.0 or deterministic returns the input.
    """

    def __call__(self, inputs, *, deterministic=None, rngs=None, example_offset=0):
        deterministic = first_from(
            deterministic,
            self.deterministic,
            error_msg=(
                "No `deterministic` argument was provided to Dropout. Pass `deterministic` to the "
                "constructor or the call, or use `nnx.view(model, deterministic=True/False)`."
            ),
        )
        if self.rate == 0.0 or deterministic:
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)  # every element dropped; zero gradient, never NaN
        rngs = first_from(
            rngs,
            self.rngs,
            error_msg="""`deterministic` is False, but no `rngs` argument was provided to Dropout
          as either a __call__ argument or class attribute.""",
        )
        if isinstance(rngs, rnglib.Rngs):
            key = rngs[self.rng_collection]()
        elif isinstance(rngs, rnglib.RngStream):
            key = rngs()
        elif isinstance(rngs, jax.Array):
            key = rngs
        else:
            raise TypeError(f"rngs must be a Rngs, RngStream or jax.Array, but got {type(rngs)}.")
        inputs = jnp.asarray(inputs)
        ndim = inputs.ndim
        broadcast = {d % ndim for d in self.broadcast_dims} if ndim else set()
        # The mask index of element (b, ...) is b * (elements per example in the mask's shape) +
        # its index within the example; an example offset shifts it by whole examples. With axis 0
        # broadcast, every example shares one mask and no offset applies.
        if ndim == 0 or 0 in broadcast:
            offset = 0
        else:
            per_example = math.prod(1 if d in broadcast else inputs.shape[d] for d in range(1, ndim))
            offset = _element_offset(example_offset, per_example)
        return jaxdet.dropout(
            inputs,
            jaxdet.random.from_jax_key(key),
            self.rate,
            offset=offset,
            broadcast_dims=tuple(self.broadcast_dims),
        )
