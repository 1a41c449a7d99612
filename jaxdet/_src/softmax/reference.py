"""NumPy reference of softmax, log_softmax and cross-entropy in the kernels' canonical order (bit-exact;
docs/softmax.md). x [R, n] float32 (widened)."""

from __future__ import annotations

import numpy as np

from jaxdet._src.core.row_reference import (
    CANONICAL_NAN,
    F32,
    as_f32,
    canonical,
    exp,
    log,
    span_max,
    span_sum,
    store,
    tree_fold,
)

SOFTMAX_SEGMENT = 8192  # elements per softmax segment

__all__ = [
    "canonical",
    "cross_entropy",
    "cross_entropy_backward",
    "exp",
    "log",
    "log_softmax",
    "softmax",
    "softmax_backward",
    "softmax_stats",
    "store",
]


def _segment_bounds(n):
    segments = 1 if n <= SOFTMAX_SEGMENT else -(-n // SOFTMAX_SEGMENT)
    return [(k * SOFTMAX_SEGMENT, min(n, (k + 1) * SOFTMAX_SEGMENT)) for k in range(segments)]


def _exp_terms(x, m):
    """e^(x - m) per element of a segment with max m [rows] (every term 0 where m = -inf)."""
    with np.errstate(invalid="ignore"):
        return np.where((m == -np.inf)[:, None], F32(0.0), exp(as_f32(x) - m[:, None])).astype(F32)


def segment_maxima(x):
    """Each segment's max m_k: [rows, segments]."""
    x = as_f32(x)
    return np.stack([span_max(x[:, a:b]) for a, b in _segment_bounds(x.shape[1])], axis=1)


def softmax_stats(x):
    """Per-row (M, S) and the segments' maxima m_k [rows, segments]: s_k = span_sum of e^(x - m_k),
    M = max of the m_k, S = the tree over the segments' terms s_k * e^(m_k - M) (0 where m_k = -inf)."""
    x = as_f32(x)
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
    x = as_f32(x)
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
        return ((as_f32(x) - M[:, None]) - log(S)[:, None]).astype(F32)


def segment_sum(terms):
    """A row sum in the softmax order: segments, canonical span sums, the tree with plain adds."""
    terms = as_f32(terms)
    parts = [span_sum(terms[:, a:b]) for a, b in _segment_bounds(terms.shape[1])]
    return tree_fold(parts, lambda a, b: a + b)


def softmax_backward(x, g, mode):
    """dx of softmax (mode "softmax") or log_softmax ("log_softmax") for cotangent g, float32."""
    p, g = prob(x, *softmax_stats(x)), as_f32(g)
    with np.errstate(invalid="ignore"):
        if mode == "softmax":
            return p * (g - segment_sum(g * p)[:, None])
        return g - p * segment_sum(g)[:, None]


def cross_entropy(x, labels, log_prob=False):
    """Per-row loss ln S - (x_label - M) (or the log-prob (x_label - M) - ln S); NaN if out of range."""
    x = as_f32(x)
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
    x = as_f32(x)
    p = prob(x, *softmax_stats(x))
    n = x.shape[1]
    labels = np.asarray(labels, np.int64)
    valid = (labels >= 0) & (labels < n)
    onehot = np.arange(n)[None, :] == labels[:, None]
    g = as_f32(g)[:, None]
    with np.errstate(invalid="ignore"):
        d = g * np.where(onehot, p - F32(1.0), p)
    invalid = np.where(g == 0, F32(0.0), CANONICAL_NAN)
    return np.where(valid[:, None], d, invalid).astype(F32)
