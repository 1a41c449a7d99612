"""Bit-level comparison for jaxdet's contracts and for users' own tests.

Determinism is checked on raw bits, never with ``allclose``: two results are equal here only when
every element has the same bit pattern (so ``-0.0 != +0.0`` and NaN payloads count).
"""

from __future__ import annotations

import numpy as np

__all__ = ["bits", "count_bit_differences", "same_bits", "assert_bitwise_equal"]

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits(x) -> np.ndarray:
    """The raw bits of an array as unsigned integers of the same width (uint16 for bfloat16)."""
    a = np.asarray(x)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view(_UINT_OF_SIZE[a.dtype.itemsize])


def count_bit_differences(x, y) -> int:
    """How many elements of two same-shape, same-dtype arrays differ in any bit."""
    a, b = np.asarray(x), np.asarray(y)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare bits of {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    return int(np.count_nonzero(bits(a) != bits(b)))


def same_bits(x, y) -> bool:
    """True when both arrays have the same dtype, shape and bits."""
    a, b = np.asarray(x), np.asarray(y)
    return a.dtype == b.dtype and a.shape == b.shape and count_bit_differences(a, b) == 0


def assert_bitwise_equal(x, y, what: str = "arrays") -> None:
    """Raise AssertionError, with where and how the bits differ, unless `x` and `y` are bit-identical."""
    a, b = np.asarray(x), np.asarray(y)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise AssertionError(f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
    diff = bits(a) != bits(b)
    n = int(np.count_nonzero(diff))
    if n:
        first = np.argwhere(diff)[:3] if a.ndim else [()]
        shown = ", ".join(
            f"{tuple(int(i) for i in idx)}: {a[tuple(idx)]!r} (0x{int(bits(a)[tuple(idx)]):x}) vs "
            f"{b[tuple(idx)]!r} (0x{int(bits(b)[tuple(idx)]):x})"
            for idx in first
        )
        raise AssertionError(f"{what}: {n} of {a.size} elements differ bitwise; first: {shown}")
