"""Batching helpers: folding a vmapped axis into a primitive's rows and back."""

from __future__ import annotations

import jax.numpy as jnp
from jax.interpreters import batching


def moved_to_front(x, dim, size):
    """`x` with its vmapped axis (or a broadcast one, if unmapped) at position 0."""
    if not_mapped(dim):
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def unfold(x, size):
    """[size * R, ...] -> [size, R, ...]: the inverse of folding a vmapped axis into the rows."""
    return x.reshape((size, x.shape[0] // size) + x.shape[1:])


def batch_size(args, dims):
    """The size of the vmapped axis (a batching rule gets at least one batched operand)."""
    return next(x.shape[d] for x, d in zip(args, dims) if not not_mapped(d))


def to_front(args, dims):
    """(size, operands): every operand with its vmapped axis first, an unmapped one broadcast."""
    size = batch_size(args, dims)
    return size, [moved_to_front(x, d, size) for x, d in zip(args, dims)]


def not_mapped(dim) -> bool:
    """True for an operand that a batching rule receives unbatched (None in jax >= 0.10)."""
    return dim is None or dim is getattr(batching, "not_mapped", None)
