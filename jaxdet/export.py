"""Serializing functions that use jaxdet with ``jax.export``.

``jax.export`` refuses custom calls that carry no backward-compatibility guarantee unless the caller
names them. jaxdet's FFI targets are such calls: an exported artifact runs only where the same jaxdet
version (the same targets, attributes and kernels) is installed and imported. Say so explicitly::

    exported = jax.export.export(jax.jit(step), disabled_checks=jaxdet.export.disabled_checks())(*args)
    blob = exported.serialize()
    # later, in a process that has imported the same jaxdet version:
    jax.export.deserialize(blob).call(*args)

docs/export.md; tests/test_export.py.
"""

from __future__ import annotations

import jax

from jaxdet._src.core import ffi

__all__ = ["disabled_checks", "target_names"]


def target_names() -> list[str]:
    """The names of every XLA FFI target this build registers (CPU, and CUDA when built)."""
    return sorted(set(ffi.CPU_TARGETS) | set(ffi.CUDA_TARGETS))


def disabled_checks() -> list:
    """``jax.export.DisabledSafetyCheck`` entries that allow exporting jaxdet's custom calls."""
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in target_names()]
