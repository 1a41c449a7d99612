"""XLA flags that make elementwise bits independent of fusion and array length on the CPU.

XLA:CPU lets LLVM contract a multiply and an add into one fused multiply-add whenever they land in
one fused loop (there is no flag against it), vectorizes erf/exp/log with other code for a
short array's tail than for its body (`xla_cpu_use_fusion_emitters`), and keeps bfloat16 values
unrounded between fused operations (`xla_allow_excess_precision`). So the same elementwise
expression could give other bits with another batch size or another fusion decision. jaxdet
turns the last two off for the process at import, before jax starts its backends (flags cannot
change afterwards); `jaxdet.invariant` blocks the contraction itself (invariant/rules.py). The
GPU needs no flag: XLA:GPU emits separately rounded multiplies and adds.
"""

from __future__ import annotations

import os


def _jaxlib_version() -> tuple:
    try:
        from importlib.metadata import version

        return tuple(int(p) for p in version("jaxlib").split(".")[:2])
    except Exception:  # pragma: no cover - no metadata: the conservative set below
        return (0, 0)


# Only flags this jaxlib's XLA knows: an unknown flag in XLA_FLAGS aborts the process. jaxlib 0.11
# has no `xla_cpu_use_fusion_emitters` (its CPU fusion emitters cannot be turned off).
DETERMINISM_FLAGS = {"xla_allow_excess_precision": "false"}
if (0, 10) <= _jaxlib_version() < (0, 11):
    DETERMINISM_FLAGS["xla_cpu_use_fusion_emitters"] = "false"


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except Exception:  # pragma: no cover - a jax without the query: assume started (never guess late)
        return True


def _flag_values(text: str) -> dict:
    values = {}
    for item in text.split():
        if item.startswith("--") and "=" in item:
            key, value = item[2:].split("=", 1)
            values[key] = value
    return values


def install() -> None:
    """Append the flags the user has not set to XLA_FLAGS, if jax has not started its backends."""
    if _backends_started():
        return
    current = os.environ.get("XLA_FLAGS", "")
    have = _flag_values(current)
    extra = [f"--{k}={v}" for k, v in DETERMINISM_FLAGS.items() if k not in have]
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()


def missing() -> list[str]:
    """The determinism flags XLA_FLAGS does not hold (the user set another value, or jax had
    started its backends before jaxdet was imported and nobody set them)."""
    have = _flag_values(os.environ.get("XLA_FLAGS", ""))
    return [f"--{k}={v}" for k, v in DETERMINISM_FLAGS.items() if have.get(k) != v]


install()
