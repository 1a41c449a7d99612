"""NumPy re-implementation of the canonical order of the norm and softmax kernels (bit-exact).

Written from the documented order (docs/norm.md, docs/softmax.md), independently of the C++ code in
cuda/common/det_math.h, cuda/norm and cuda/softmax: every operation is one float32 NumPy operation
(IEEE, round to nearest even, no FMA, subnormals kept), so the results must equal the CPU and GPU
kernels bit for bit. Used by tests/test_norm.py, tests/test_softmax.py and the report's checks.
Slow but vectorised over rows; meant for small shapes.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
LANES = 256  # lanes of a span reduction
VEC = 4  # consecutive elements per lane and step
STEP = LANES * VEC
SOFTMAX_SEGMENT = 8192  # elements per softmax segment
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


def _f32(x):
    return np.asarray(x, dtype=F32)


def canonical(x):
    x = _f32(x).copy()
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
    x = _f32(x)
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
    x = _f32(x)
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
    a, b = _f32(a), _f32(b)
    eq = (a.view(np.uint32) & b.view(np.uint32)).view(F32)
    out = np.where(a > b, a, np.where(b > a, b, eq))
    return np.where(np.isnan(a) | np.isnan(b), CANONICAL_NAN, out).astype(F32)


# ---- Span reductions: terms [rows, n] float32 -> [rows] in the canonical order. ----


def span_sum(terms):
    """Lane (e // 4) % 256 folds its terms in increasing e from +0; then the pairwise lane tree."""
    terms = _f32(terms)
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
    x = _f32(x)
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


# ---- RMSNorm / LayerNorm (docs/norm.md). x [T, n] (any float dtype, widened exactly), w, b [n]. ----


def norm_forward(x, w, b, eps, center):
    """(y float32 before storage rounding, mean [T], rstd [T])."""
    x = _f32(x)
    n = x.shape[1]
    nf = F32(n)
    mean = span_sum(x) / nf if center else np.zeros(x.shape[0], F32)
    d = x - mean[:, None]
    rstd = F32(1.0) / np.sqrt(span_sum(d * d) / nf + F32(eps))
    y = (d * rstd[:, None]) * _f32(w)[None, :]
    if b is not None:
        y = y + _f32(b)[None, :]
    return y, mean, rstd


def norm_backward(x, w, g, mean, rstd, center):
    """(dx float32, per-token scale terms g * xhat [T, n])."""
    x, g = _f32(x), _f32(g)
    nf = F32(x.shape[1])
    xhat = (x - mean[:, None]) * rstd[:, None]
    gw = g * _f32(w)[None, :]
    mb = span_sum(gw * xhat) / nf
    t = gw - xhat * mb[:, None]
    if center:
        t = t - (span_sum(gw) / nf)[:, None]
    return rstd[:, None] * t, g * xhat


def token_tree(terms):
    """The canonical tree over tokens (axis 0) of float32 per-token terms [T, n]."""
    return tree_fold(list(_f32(terms)), lambda a, b: a + b)


# ---- softmax, log_softmax, cross-entropy (docs/softmax.md). x [R, n] float32 (widened). ----


def _segment_bounds(n):
    segments = 1 if n <= SOFTMAX_SEGMENT else -(-n // SOFTMAX_SEGMENT)
    return [(k * SOFTMAX_SEGMENT, min(n, (k + 1) * SOFTMAX_SEGMENT)) for k in range(segments)]


def _exp_terms(x, m):
    """e^(x - m) per element of a segment with max m [rows] (every term 0 where m = -inf)."""
    with np.errstate(invalid="ignore"):
        return np.where((m == -np.inf)[:, None], F32(0.0), exp(_f32(x) - m[:, None])).astype(F32)


def segment_maxima(x):
    """Each segment's max m_k: [rows, segments]."""
    x = _f32(x)
    return np.stack([span_max(x[:, a:b]) for a, b in _segment_bounds(x.shape[1])], axis=1)


def softmax_stats(x):
    """Per-row (M, S) and the segments' maxima m_k [rows, segments]: s_k = span_sum of e^(x - m_k),
    M = max of the m_k, S = the tree over the segments' terms s_k * e^(m_k - M) (0 where m_k = -inf)."""
    x = _f32(x)
    m = segment_maxima(x)
    M = span_max(m)
    leaves = []
    for k, (a, b) in enumerate(_segment_bounds(x.shape[1])):
        s_k = span_sum(_exp_terms(x[:, a:b], m[:, k]))
        with np.errstate(invalid="ignore"):
            leaf = np.where(m[:, k] == -np.inf, F32(0.0), s_k * exp(m[:, k] - M))
        leaves.append(leaf.astype(F32))
    return M, tree_fold(leaves, lambda a, b: a + b), m


def prob(x, M, S, m):
    """e^(x - m_k) * w_k per element of segment k, w_k = e^(m_k - M) * (1 / S)."""
    x = _f32(x)
    out = np.empty_like(x)
    with np.errstate(invalid="ignore", divide="ignore"):
        inv_s = (F32(1.0) / S).astype(F32)
        for k, (a, b) in enumerate(_segment_bounds(x.shape[1])):
            w = (exp(m[:, k] - M) * inv_s).astype(F32)
            out[:, a:b] = _exp_terms(x[:, a:b], m[:, k]) * w[:, None]
    return out


def softmax(x):
    return prob(x, *softmax_stats(x))


def log_softmax(x):
    M, S, _ = softmax_stats(x)
    with np.errstate(invalid="ignore"):
        return ((_f32(x) - M[:, None]) - log(S)[:, None]).astype(F32)


def segment_sum(terms):
    """A row sum in the softmax order: segments, canonical span sums, the tree with plain adds."""
    terms = _f32(terms)
    parts = [span_sum(terms[:, a:b]) for a, b in _segment_bounds(terms.shape[1])]
    return tree_fold(parts, lambda a, b: a + b)


def softmax_backward(x, g, mode):
    """dx of softmax (mode "softmax") or log_softmax ("log_softmax") for cotangent g, float32."""
    p, g = prob(x, *softmax_stats(x)), _f32(g)
    with np.errstate(invalid="ignore"):
        if mode == "softmax":
            return p * (g - segment_sum(g * p)[:, None])
        return g - p * segment_sum(g)[:, None]


def cross_entropy(x, labels, log_prob=False):
    """Per-row loss ln S - (x_label - M) (or the log-prob (x_label - M) - ln S); NaN if out of range."""
    x = _f32(x)
    M, S, _ = softmax_stats(x)
    n = x.shape[1]
    labels = np.asarray(labels, np.int64)
    valid = (labels >= 0) & (labels < n)
    xl = x[np.arange(x.shape[0]), np.where(valid, labels, 0)]
    with np.errstate(invalid="ignore"):
        out = ((xl - M) - log(S)) if log_prob else (log(S) - (xl - M))
    return np.where(valid, canonical(out), CANONICAL_NAN).astype(F32)


def cross_entropy_backward(x, labels, g):
    """g * (p - one_hot(label)); an out-of-range label: 0 where g == 0, else NaN."""
    x = _f32(x)
    p = prob(x, *softmax_stats(x))
    n = x.shape[1]
    labels = np.asarray(labels, np.int64)
    valid = (labels >= 0) & (labels < n)
    onehot = np.arange(n)[None, :] == labels[:, None]
    g = _f32(g)[:, None]
    with np.errstate(invalid="ignore"):
        d = g * np.where(onehot, p - F32(1.0), p)
    invalid = np.where(g == 0, F32(0.0), CANONICAL_NAN)
    return np.where(valid[:, None], d, invalid).astype(F32)
