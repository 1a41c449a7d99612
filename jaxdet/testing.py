"""Bit-level asserts for users' own models: batch invariance, determinism, bit differences (docs/testing.md)."""

from jaxdet._src.core.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_deterministic,
    bits,
    count_bit_differences,
    describe_bit_differences,
    same_bits,
)

__all__ = [
    "bits",
    "count_bit_differences",
    "same_bits",
    "assert_bitwise_equal",
    "describe_bit_differences",
    "assert_batch_invariant",
    "assert_deterministic",
]
