"""Philox4x32-10 keys for jaxdet.dropout: ``key``, ``split``, ``fold_in``, ``from_jax_key`` (docs/random.md)."""

from jaxdet._src.dropout.random import FOLD_TAG, JAX_TAG, fold_in, from_jax_key, key, philox4x32_10, split

__all__ = ["key", "fold_in", "split", "from_jax_key", "philox4x32_10", "FOLD_TAG", "JAX_TAG"]
