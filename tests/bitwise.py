"""Bitwise comparison helpers shared by the tests: determinism is checked on raw bits, never with
allclose."""

import numpy as np


def bits(x):
    """The raw bits of an array (uint32 for 4-byte floats, uint16 for bfloat16/float16)."""
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


def assert_bitwise(x, y):
    x, y = np.asarray(x), np.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, x.dtype, y.shape, y.dtype)
    diff = int(np.count_nonzero(bits(x) != bits(y)))
    assert diff == 0, f"{diff} of {x.size} elements differ bitwise"
