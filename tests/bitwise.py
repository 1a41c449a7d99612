"""The tests' bit comparison: jaxdet.testing's helpers (one implementation for the report, the
tests and users)."""

from jaxdet.testing import assert_bitwise_equal as assert_bitwise  # noqa: F401
from jaxdet.testing import bits  # noqa: F401
