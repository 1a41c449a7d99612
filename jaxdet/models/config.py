"""What the reference decoders' configurations share: their sizes and dtype, checked once."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DecoderSizes:
    """A decoder's sizes and its parameters' dtype. Every int field (a subclass's too) is a size and
    must be a positive int; d_model must be a multiple of n_heads. The defaults are a small model;
    each decoder's configuration subclasses this one."""

    vocab: int = 97
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 128
    max_len: int = 32
    dtype: object = jnp.float32

    def __post_init__(self):
        config = type(self).__name__
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in (int, "int") and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{config}.{field.name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"{config}.d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
