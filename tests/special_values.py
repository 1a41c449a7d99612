"""Inputs with special values for the bitwise tests of the GPU kernels (tests/test_attention.py and its
worker, tests/attention_cores_worker.py)."""

import jax.numpy as jnp
import numpy as np


def sprinkle_special(x, rng, dtype):
    """float32 copy of x with NaN, +-inf, huge (bfloat16: products overflow float32), tiny (subnormal in
    dtype) and zero entries at random places drawn from rng, and the row x[0, 5] all zero."""
    x = np.array(x, np.float32)
    flat = x.reshape(-1)
    n = flat.size
    huge = 1e30 if dtype == jnp.bfloat16 else 6e4
    tiny = 1e-39 if dtype == jnp.bfloat16 else 1e-6
    for value, count in ((np.nan, 3), (np.inf, 3), (-np.inf, 3), (huge, 40), (-huge, 40), (tiny, 200), (0.0, 200)):
        flat[rng.integers(0, n, count)] = value
    x[0, min(5, x.shape[1] - 1)] = 0.0
    return x
