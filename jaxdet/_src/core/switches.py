"""The one testing switch of jaxdet's native code: the environment variable JAXDET_TESTING.

A comma-separated list of ``key=value`` items, read once per process by the native code
(cuda/common/testing.h; docs/DEVELOPING.md):

- ``gemm=sm80``: the CUDA GEMM runs its sm_80 kernels on a Hopper GPU too;
- ``gemm_tile=ROWSxCOLS``: every call of an M-bucketed CUDA GEMM kernel set (forward and dA) runs
  that output tile, whatever the shape (docs/matmul_cuda.md, "M buckets"); it cannot change a bit;
- ``cpu_gemm=avx512|avx2|generic``: the CPU GEMM variant (refused if this CPU lacks it);
- ``softmax=passes``: softmax, log_softmax and cross-entropy run rows of 2-16 segments by their
  multi-pass CUDA kernels on a GPU with clusters too, as on an Ampere GPU (docs/softmax.md); it
  cannot change a bit;
- ``attention=mma``: the bfloat16/float16 attention forward and backward run their mma.sync
  kernels on a Hopper GPU too (instead of wgmma; docs/attention.md); ``attention=wgmma``: its Hopper final mode runs
  one-warpgroup wgmma CTAs instead of the warp-specialized ones; ``attention=one_warp_splits``: its
  split mode runs one warp per split where it would run eight (decode steps);
  ``attention=eight_warp_splits``: its split mode runs eight warps per split on any grid (head
  dimension 128), not only on grids of at most a CTA per SM;
  ``attention=split_combine``: the eight-warp splits leave their merge to a second kernel where a
  cluster of them would merge it; none can change a bit.

An item changes which kernel runs, so, like the device model, it is part of what the bits may
depend on: it exists for the tests that compare kernels, and the report names every active item.
"""

from __future__ import annotations

import os

TESTING_ENV = "JAXDET_TESTING"

# key -> accepted values
TESTING_ITEMS = {
    "gemm": ("sm80",),
    # the tiles of cuda/gemm/kernels.cmake (Hopper, then sm_80); the native code refuses a tile
    # that the running kernel set does not have
    "gemm_tile": ("128x256", "64x256", "64x128", "64x64", "16x64", "16x32", "16x16", "64x32", "128x128"),
    "cpu_gemm": ("avx512", "avx2", "generic"),
    "softmax": ("passes",),
    "attention": ("mma", "wgmma", "one_warp_splits", "eight_warp_splits", "split_combine"),
}


def _accepted() -> str:
    return ", ".join(f"{key}={'|'.join(values)}" for key, values in TESTING_ITEMS.items())


def parse_testing_overrides(value: str | None) -> dict[str, str]:
    """The items of a JAXDET_TESTING value as {key: value} (empty for None or "").

    Raises ValueError, naming the variable and the accepted items, for an item that is not
    ``key=value``, an unknown key or value, or a key given twice.
    """
    items: dict[str, str] = {}
    for raw in (value or "").split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, val = (part.strip() for part in item.partition("="))
        if not sep or key not in TESTING_ITEMS or val not in TESTING_ITEMS[key] or key in items:
            why = "is given twice" if key in items and sep else "is not an accepted item"
            raise ValueError(
                f"{TESTING_ENV}={value!r}: {item!r} {why}. {TESTING_ENV} is a comma-separated list of "
                f"testing overrides; the accepted items are {_accepted()} (unset it for normal use)."
            )
        items[key] = val
    return items


def validate_testing_env(environ=None) -> dict[str, str]:
    """Check JAXDET_TESTING in `environ` (default os.environ); return its items.

    Raises ValueError for a malformed or unknown item, and for a ``cpu_gemm`` variant this CPU lacks.
    """
    environ = os.environ if environ is None else environ
    items = parse_testing_overrides(environ.get(TESTING_ENV))
    if "cpu_gemm" in items:
        from jaxdet import _native

        supported = list(_native.cpu_gemm_variants())
        if items["cpu_gemm"] not in supported:
            raise ValueError(
                f"{TESTING_ENV}: cpu_gemm={items['cpu_gemm']} is not supported by this CPU "
                f"(supported here: {', '.join(supported)})."
            )
    return items


def active_testing_overrides() -> dict[str, str]:
    """The items of JAXDET_TESTING as the native code read them (once per process); {} when unset."""
    from jaxdet import _native

    return dict(_native.testing_overrides())
