"""NumPy re-implementation of the row kernels' shared arithmetic (bit-exact): cuda/common/det_math.h's
exp and log, the span reductions and the canonical tree.

Written from the documented order (docs/norm.md, docs/softmax.md), independently of the C++ code:
every operation is one float32 NumPy operation (IEEE, round to nearest even, no FMA, subnormals
kept), so the results must equal the CPU and GPU kernels bit for bit. The norm and softmax packages'
references (``reference.py``) are built from it. Slow but vectorised over rows; meant for small shapes.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
LANES = 256  # lanes of a span reduction
VEC = 4  # consecutive elements per lane and step
STEP = LANES * VEC
CANONICAL_NAN = np.uint32(0x7FC00000).view(F32)

_LOG2E = F32(float.fromhex("0x1.715476p+0"))
_SHIFT = F32(12582912.0)
_LN2_HI = F32(float.fromhex("0x1.62e4p-1"))  # 0.693145751953125
_LN2_LO = F32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_POLY = [
    F32(float.fromhex(h))
    for h in ("0x1.a01a02p-13", "0x1.6c16c2p-10", "0x1.111112p-7", "0x1.555556p-5", "0x1.555556p-3")
] + [F32(0.5), F32(1.0), F32(1.0)]
_LOG_POLY = [F32(float.fromhex(h)) for h in ("0x1.c71c72p-3", "0x1.24924ap-2", "0x1.99999ap-2", "0x1.555556p-1")]


def as_f32(x):
    return np.asarray(x, dtype=F32)


def canonical(x):
    x = as_f32(x).copy()
    x[np.isnan(x)] = CANONICAL_NAN
    return x


def _pow2(k):
    return ((k.astype(np.int64) + 127) << 23).astype(np.uint32).view(F32)


def fma(a, b, c):
    """float32 a * b + c with one rounding (det_math.h's fma): a * b is exact in float64, the
    float64 sum is rounded to odd (its error by TwoSum), and rounding that to float32 is then the
    correctly rounded result (53 >= 24 + 2 bits)."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in np.broadcast_arrays(a, b, c))
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bb = s - p
        err = (p - (s - bb)) + (c - bb)
        even = (s.view(np.uint64) & np.uint64(1)) == 0
        toward = np.where(err > 0, np.inf, -np.inf)
        s = np.where((err != 0) & even & np.isfinite(s), np.nextafter(s, toward), s)
    return s.astype(F32)


def exp(x):
    """e^x as det_math.h computes it (Cody-Waite reduction, degree-7 Taylor by fused multiply-adds,
    two-step scaling)."""
    x = as_f32(x)
    with np.errstate(all="ignore"):
        xc = np.where((x > F32(89.0)) | (x < F32(-104.0)) | np.isnan(x), F32(0.0), x)
        kf = fma(xc, _LOG2E, _SHIFT) - _SHIFT
        r = fma(-kf, _LN2_LO, fma(-kf, _LN2_HI, xc))
        p = np.full_like(r, _EXP_POLY[0])
        for c in _EXP_POLY[1:]:
            p = fma(p, r, c)
        k = kf.astype(np.int64)
        k1 = np.where(k < 0, -((-k) // 2), k // 2)  # C++ division truncates toward zero
        out = (p * _pow2(k1)) * _pow2(k - k1)
    out = np.where(x > F32(89.0), F32(np.inf), out)
    out = np.where(x < F32(-104.0), F32(0.0), out)
    return canonical(np.where(np.isnan(x), CANONICAL_NAN, out).astype(F32))


def log(x):
    """ln(x) as det_math.h computes it (m in [sqrt(1/2), sqrt(2)), the 2 atanh series)."""
    x = as_f32(x)
    u = x.view(np.uint32).astype(np.int64)
    with np.errstate(all="ignore"):
        sub = (u > 0) & (u < 0x00800000)
        u = np.where(sub, (x * F32(8388608.0)).view(np.uint32).astype(np.int64), u)
        e = np.where(sub, -23, 0) + (u >> 23) - 127
        mbits = (u & 0x007FFFFF) | 0x3F800000
        big = mbits > 0x3FB504F3
        mbits = np.where(big, mbits - 0x00800000, mbits)
        e = e + big
        f = mbits.astype(np.uint32).view(F32) - F32(1.0)
        hfsq = F32(0.5) * (f * f)
        s = f / (F32(2.0) + f)
        z = s * s
        R = np.full_like(z, _LOG_POLY[0])
        for c in _LOG_POLY[1:]:
            R = R * z + c
        R = R * z
        dk = e.astype(F32)
        lo = s * (hfsq + R) + dk * _LN2_LO
        out = dk * _LN2_HI - ((hfsq - lo) - f)
    out = np.where(x == 0, F32(-np.inf), out)
    out = np.where(x < 0, CANONICAL_NAN, out)
    out = np.where(np.isposinf(x), F32(np.inf), out)
    return canonical(np.where(np.isnan(x), CANONICAL_NAN, out).astype(F32))


def fmax(a, b):
    """det_math.h's max: NaN-propagating (canonical), max(+0, -0) = +0; independent of order."""
    a, b = as_f32(a), as_f32(b)
    eq = (a.view(np.uint32) & b.view(np.uint32)).view(F32)
    out = np.where(a > b, a, np.where(b > a, b, eq))
    return np.where(np.isnan(a) | np.isnan(b), CANONICAL_NAN, out).astype(F32)


# ---- Span reductions: terms [rows, n] float32 -> [rows] in the canonical order. ----


def span_sum(terms):
    """Lane (e // 4) % 256 folds its terms in increasing e from +0; then the pairwise lane tree."""
    terms = as_f32(terms)
    rows, n = terms.shape
    steps = max(1, -(-n // STEP))
    padded = np.zeros((rows, steps * STEP), F32)  # absent terms add +0: a lane sum is never -0
    padded[:, :n] = terms
    padded = padded.reshape(rows, steps, LANES, VEC)
    acc = np.zeros((rows, LANES), F32)
    for k in range(steps):
        for j in range(VEC):
            acc = acc + padded[:, k, :, j]
    s = LANES // 2
    while s >= 1:
        acc = acc[:, :s] + acc[:, s : 2 * s]
        s //= 2
    return acc[:, 0]


def span_max(x):
    """The row maximum as det_math.h's max defines it (order-free): NaN if any NaN, +0 over -0."""
    x = as_f32(x)
    with np.errstate(invalid="ignore"):
        m = np.max(x, axis=1, initial=-np.inf).astype(F32)
    plus_zero = np.any((x == 0) & ~np.signbit(x), axis=1)
    m = np.where((m == 0) & plus_zero, F32(0.0), m)
    return np.where(np.isnan(x).any(axis=1), CANONICAL_NAN, m).astype(F32)


def tree_fold(items, combine):
    """The padded balanced tree over a list, lower index first (jaxdet.parallel.tree_sum's tree)."""
    items = list(items)
    while len(items) > 1:
        items = [combine(items[i], items[i + 1]) if i + 1 < len(items) else items[i] for i in range(0, len(items), 2)]
    return items[0]


def store(y, dtype):
    """Rounds float32 results to the storage dtype (RNE), NaN as the canonical quiet NaN."""
    return canonical(y).astype(dtype)


def token_tree(terms):
    """The canonical tree over tokens (axis 0) of float32 per-token terms [T, n]."""
    return tree_fold(list(as_f32(terms)), lambda a, b: a + b)
