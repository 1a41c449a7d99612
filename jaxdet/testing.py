"""Bit-level asserts for users' own models: batch invariance, determinism, bit differences (docs/testing.md)."""

from jaxdet._src.core.testing import *  # noqa: F403
from jaxdet._src.core.testing import __all__  # noqa: F401
