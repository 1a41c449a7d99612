"""Helpers shared by the row-wise primitives (norms, softmax): argument checks, vmap folding, and the
canonical tree over parameter-gradient partials."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet import _ffi
from jaxdet._checks import float_dtype_of, is_traced


def check_float_array(x, name: str):
    """`x` as a jax array of float32/bfloat16/float16, or a TypeError naming `name`."""
    float_dtype_of(x, name)
    return jnp.asarray(x)


def check_eps(eps, name: str = "eps") -> float:
    if is_traced(eps):
        raise TypeError(f"{name} must be a static Python float (it is a kernel attribute), got a traced value")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name} must be a Python float, got {type(eps).__name__}")
    value = float(eps)
    if not (value >= 0.0 and np.isfinite(value)):
        raise ValueError(f"{name} must be a finite float >= 0, got {eps!r}")
    return value


def check_axis(axis, ndim: int, name: str = "axis") -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(axis).__name__}")
    axis = int(axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def moved_to_front(x, dim, size):
    """`x` with its vmapped axis (or a broadcast one, if unmapped) at position 0."""
    if _ffi.not_mapped(dim):
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, dim, 0)


def unfold(x, size):
    """[size * R, ...] -> [size, R, ...]: the inverse of folding a vmapped axis into the rows."""
    return x.reshape((size, x.shape[0] // size) + x.shape[1:])


def batch_size(args, dims):
    return next(x.shape[d] for x, d in zip(args, dims) if not _ffi.not_mapped(d))


def shaped(shape, dtype):
    return jax.core.ShapedArray(tuple(shape), dtype)
