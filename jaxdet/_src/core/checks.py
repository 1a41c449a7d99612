"""Argument checks shared by the primitives: clear errors before any kernel runs."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

KEY_HELP = (
    "make one with jaxdet.random.key(seed), derive more with jaxdet.random.split / fold_in, or convert "
    "a jax.random key with jaxdet.random.from_jax_key(key)"
)


FLOAT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))


def float_dtype_of(x, name: str) -> np.dtype:
    """The dtype of `x`, an array of float32/bfloat16/float16; else a TypeError naming `name`."""
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}")
    dtype = np.dtype(x.dtype)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {dtype.name}")
    return dtype


def is_traced(value) -> bool:
    return isinstance(value, jax.core.Tracer)


def check_philox_key(key, name: str = "key"):
    """Return `key` as a uint32[2] array, or raise naming `name` and how to make a Philox key."""
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(f"{name} is a jax.random key ({dtype}); jaxdet uses its own uint32[2] Philox keys: {KEY_HELP}.")
    if dtype is None or not hasattr(key, "shape"):
        raise TypeError(f"{name} must be a uint32[2] Philox key array, got {type(key).__name__}; {KEY_HELP}.")
    if np.dtype(dtype) != np.uint32 or tuple(key.shape) != (2,):
        raise TypeError(
            f"{name} must be a uint32[2] Philox key, got {np.dtype(dtype).name}{list(key.shape)}; {KEY_HELP}."
        )
    return jnp.asarray(key)


def check_static_int(value, name: str, *, minimum: int | None = None) -> int:
    if is_traced(value):
        raise TypeError(
            f"{name} must be a static Python int (it decides the compiled kernel's attributes), got a traced value"
        )
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Integral, np.integer)):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_static_float(value, name: str) -> float:
    if is_traced(value):
        raise TypeError(f"{name} must be a static Python float, got a traced value")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    return float(value)


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


def accumulated_result_dtype(dtype, requested, name: str) -> np.dtype:
    """The result dtype of a float32-accumulated reduction of `dtype` inputs: `requested` (the
    argument `name`), which may be None (the input dtype), the input dtype or float32."""
    if requested is None:
        return np.dtype(dtype)
    try:
        want = np.dtype(requested)
    except TypeError:
        raise TypeError(f"{name} must be a dtype or None, got {requested!r}") from None
    if want in (np.dtype(dtype), np.dtype(np.float32)):
        return want
    raise TypeError(
        f"{name} must be None, the input dtype ({np.dtype(dtype).name}) or float32, got {want.name} "
        "(jaxdet accumulates in float32 and rounds once to the result dtype)"
    )
