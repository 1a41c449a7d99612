"""NumPy reference of the canonical sum (docs/reduce.md), written from the rule (bit-exact).

Every add is one float32 NumPy add (IEEE, round to nearest even, no FMA, subnormals kept), so the
results must equal the CPU and GPU kernels bit for bit. Vectorised over the outputs, a Python loop
over the reduced elements: meant for small shapes.
"""

from __future__ import annotations

import math

import numpy as np

from jaxdet._src.core.row_reference import F32, as_f32, store, tree_fold

__all__ = ["chunk_partials", "canonical_sum", "left_fold", "store"]


def chunk_partials(x2, chunk):
    """x2 [M, K] (float32; row m holds output m's reduced elements in k order) -> the float32 chunk
    partials, each [M]: chunk c folds k in [c * chunk, (c + 1) * chunk) ascending from +0."""
    M, K = x2.shape
    parts = []
    with np.errstate(invalid="ignore", over="ignore"):
        for k0 in range(0, K, chunk):
            acc = np.zeros(M, F32)
            for k in range(k0, min(K, k0 + chunk)):
                acc = acc + x2[:, k]
            parts.append(acc)
    return parts


def _as_rows(x, axes):
    """x with the kept axes first (in order) and the reduced ones last (in order), as [M, K]."""
    x = np.asarray(x)
    axes = tuple(sorted(a % x.ndim for a in axes))
    kept = tuple(i for i in range(x.ndim) if i not in axes)
    out_shape = tuple(x.shape[i] for i in kept)
    K = math.prod(x.shape[i] for i in axes)
    return as_f32(x).transpose(kept + axes).reshape(math.prod(out_shape), K), out_shape


def canonical_sum(x, axes, out_dtype=None, chunk=None):
    """x summed over `axes` by the rule: chunk partials combined by the canonical tree (float32),
    rounded once to out_dtype (default x's dtype), NaN stored canonical."""
    from jaxdet._src.reduce.reduce import CHUNK_TOKENS

    out_dtype = np.dtype(out_dtype or np.asarray(x).dtype)
    x2, out_shape = _as_rows(x, axes)
    if x2.shape[1] == 0:
        return np.zeros(out_shape, out_dtype)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN, as on the devices
        root = tree_fold(chunk_partials(x2, chunk or CHUNK_TOKENS), lambda a, b: a + b)
    return store(root, out_dtype).reshape(out_shape)


def left_fold(x, axes, out_dtype=None):
    """The whole reduced range folded left to right from +0 in float32 (no chunks): what the rule is
    not beyond 3 chunks (the tests show they differ there, so they tell the orders apart)."""
    out_dtype = np.dtype(out_dtype or np.asarray(x).dtype)
    x2, out_shape = _as_rows(x, axes)
    return store(chunk_partials(x2, max(x2.shape[1], 1))[0], out_dtype).reshape(out_shape)
