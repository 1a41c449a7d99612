"""A NumPy re-implementation of the canonical clipping order (cuda/clip/clip_math.h), written from the
documented order only, for tests and self-checks: the native targets must match it bit for bit.

NumPy float32 / float64 arithmetic is IEEE (round to nearest even, subnormals kept), as the kernels'.
"""

from __future__ import annotations

import numpy as np

CHUNK = 4096
LANES = 256
VEC = 4
STEPS = CHUNK // (LANES * VEC)
FINAL_LANES = 1024
CANONICAL_NAN = np.uint32(0x7FC00000).view(np.float32)


def _canonical(x: np.ndarray) -> np.ndarray:
    x = np.array(x, dtype=np.float32, copy=True)
    x[np.isnan(x)] = CANONICAL_NAN
    return x


def chunk_partials(leaf) -> np.ndarray:
    """Steps 1-3: the float32 partial of each 4096-element chunk of one leaf."""
    f = np.asarray(leaf).astype(np.float32).ravel()
    chunks = -(-f.size // CHUNK)
    if chunks == 0:
        return np.zeros((0,), np.float32)
    padded = np.zeros(chunks * CHUNK, np.float32)  # a skipped element and + (+0) give the same bits
    padded[: f.size] = f
    sq = padded.reshape(chunks, STEPS, LANES, VEC)
    sq = sq * sq
    acc = np.zeros((chunks, LANES), np.float32)
    with np.errstate(all="ignore"):
        for k in range(STEPS):
            for j in range(VEC):
                acc = acc + sq[:, k, :, j]
        s = LANES // 2
        while s >= 1:
            acc[:, :s] = acc[:, :s] + acc[:, s : 2 * s]
            s //= 2
    return acc[:, 0].copy()


def norm_from_slots(slots: np.ndarray) -> np.float32:
    """Step 4: float64 lanes over the slots, pairwise tree, sqrt, one rounding to float32."""
    slots = np.asarray(slots, np.float32).astype(np.float64)
    rows = -(-slots.size // FINAL_LANES)
    padded = np.zeros(max(rows, 1) * FINAL_LANES, np.float64)
    padded[: slots.size] = slots
    padded = padded.reshape(-1, FINAL_LANES)
    with np.errstate(all="ignore"):
        lane = np.zeros(FINAL_LANES, np.float64)
        for r in range(padded.shape[0]):
            lane = lane + padded[r]
        s = FINAL_LANES // 2
        while s >= 1:
            lane[:s] = lane[:s] + lane[s : 2 * s]
            s //= 2
        return _canonical(np.float32(np.sqrt(lane[0])))[()]


def global_norm(leaves) -> np.float32:
    parts = [chunk_partials(x) for x in leaves]
    return norm_from_slots(np.concatenate(parts) if parts else np.zeros((0,), np.float32))


def decision(norm: float, max_norm: float, nonfinite: str = "propagate"):
    """Step 5: ('identity' | 'multiply' | 'zero', float32 scale)."""
    norm = np.float32(norm)
    max_norm = np.float32(max_norm)
    if nonfinite == "skip" and not np.isfinite(norm):
        return "zero", np.float32(0)
    if max_norm == np.float32(np.inf):
        return "identity", np.float32(1)
    if not np.isnan(max_norm) and max_norm < 0:
        max_norm = np.float32(0)
    if norm <= max_norm:
        return "identity", np.float32(1)
    with np.errstate(all="ignore"):
        scale = _canonical(np.float32(max_norm / norm))[()]
    if scale == np.float32(1):
        return "identity", np.float32(1)
    return "multiply", scale


def clip_leaf(leaf, mode: str, scale) -> np.ndarray:
    x = np.asarray(leaf)
    if mode == "identity":
        return x.copy()
    if mode == "zero":
        return np.zeros_like(x)
    with np.errstate(all="ignore"):
        y = _canonical(x.astype(np.float32) * np.float32(scale))
    return y.astype(x.dtype)


def clip_by_global_norm(leaves, max_norm, nonfinite: str = "propagate"):
    """(clipped leaves, norm) in the canonical order, for a list of NumPy arrays."""
    norm = global_norm(leaves)
    mode, scale = decision(norm, max_norm, nonfinite)
    return [clip_leaf(x, mode, scale) for x in leaves], norm
