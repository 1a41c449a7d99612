// The row statistics and per-element formulas of softmax, log_softmax and cross-entropy, compiled
// for host and device (docs/softmax.md states them; jaxdet/_row_reference.py re-implements them).
//
// A row of n elements is cut into segments of kSegment elements (the last may be short; a row of
// at most kSegment elements is one segment). Per segment k: m_k = its max (order-free,
// detmath::max) and s_k = the canonical span sum (det_math.h) of e^(x - m_k) (every term 0 when
// m_k = -inf). M = the max of the m_k (the row's max); S = the canonical padded tree
// (detmath::tree_fold) with plain addition over the segments' terms s_k * e^(m_k - M). A
// probability is e^(x - m_k) * w_k with w_k = e^(m_k - M) * (1 / S). Every other row sum (of g * p,
// or of g, in the backward) uses the same segments and tree. Everything is float32, rounded after
// every operation. Each segment is reduced against its own max, so no segment waits for the others
// before its exponentials (one per element); with one segment (m_0 = M, e^0 = 1) S = s_0 and
// w_0 = 1 / S.
//
// The statistics a forward saves for its backward: float32 [R, stat_width(n)] = M, S and (rows of
// several segments) every m_k.
#pragma once

#include <cstdint>

#include "common/det_math.h"

namespace jaxdet {
namespace softmax {

namespace dm = ::jaxdet::detmath;

constexpr int64_t kSegment = 8192;                      // elements per segment
constexpr int kSegmentSteps = kSegment / dm::kStep;     // span steps of a whole segment (8)

enum Mode : int32_t {
  kSoftmax = 0,
  kLogSoftmax = 1,
};

JAXDET_HD int64_t segment_count(int64_t n) { return n <= kSegment ? 1 : (n + kSegment - 1) / kSegment; }
JAXDET_HD int64_t segment_length(int64_t n, int64_t seg) {
  const int64_t rest = n - seg * kSegment;
  return rest < kSegment ? rest : kSegment;
}

JAXDET_HD int64_t stat_width(int64_t n) { return segment_count(n) > 1 ? 2 + segment_count(n) : 2; }

// 1 / S, once per row: every probability is a product with it (a division per element would cost
// the GPU a slow-path branch per element, which keeps it from interleaving the elements' math).
JAXDET_HD float reciprocal(float S) { return dm::div(1.0f, S); }

// Where a segment's exponentials are taken from: its max m, or 0 for a segment of -inf (all its x
// are -inf, and e^(-inf - 0) = 0): one test per segment, none per element.
JAXDET_HD float exp_origin(float m) { return m == dm::neg_inf() ? 0.0f : m; }

// e^(x - origin) for origin = exp_origin(m) (computed once per segment by the kernels).
JAXDET_HD float exp_from(float x, float origin) { return dm::exp_nonpositive(dm::sub(x, origin)); }

// The term S sums for element x of a segment whose max is m: e^(x - m), 0 when m = -inf. x - m is
// never positive (NaN when the segment has one), hence exp_nonpositive.
JAXDET_HD float exp_term(float x, float m) { return exp_from(x, exp_origin(m)); }

// Segment k's leaf of S's tree: s_k * e^(m_k - M) (0 for a segment of -inf).
JAXDET_HD float segment_term(float s, float m, float M) {
  return m == dm::neg_inf() ? 0.0f : dm::mul(s, dm::exp_nonpositive(dm::sub(m, M)));
}

// Segment k's weight w_k = e^(m_k - M) * (1 / S) (inv_s = reciprocal(S)).
JAXDET_HD float segment_weight(float m, float M, float inv_s) {
  return dm::mul(dm::exp_nonpositive(dm::sub(m, M)), inv_s);
}

// p = e^(x - m) * w for an element of a segment with max m and weight w: softmax's output before
// storage rounding, and the probabilities every backward uses.
JAXDET_HD float prob(float x, float m, float w) { return dm::mul(exp_term(x, m), w); }

// A segment's max m and weight w from a row's statistics (stat_width(n) floats: M, S, m_k ...).
struct SegmentScale {
  float m, w;
};
JAXDET_HD SegmentScale segment_scale(const float* row_stats, int64_t seg, int64_t segments) {
  const float M = row_stats[0];
  const float m = segments > 1 ? row_stats[2 + seg] : M;
  return SegmentScale{m, segment_weight(m, M, reciprocal(row_stats[1]))};
}

// log_softmax = (x - M) - ln S.
JAXDET_HD float log_prob(float x, float M, float log_s) { return dm::sub(dm::sub(x, M), log_s); }

// Cross-entropy of the label's logit: ln S - (x_label - M), which is -log_prob bit for bit
// (round-to-nearest-even is symmetric). An out-of-range label gives NaN.
JAXDET_HD float cross_entropy(float x_label, float M, float log_s, bool valid) {
  return valid ? dm::canonical(dm::sub(log_s, dm::sub(x_label, M))) : dm::nan();
}
JAXDET_HD float label_log_prob(float x_label, float M, float log_s, bool valid) {
  return valid ? dm::canonical(log_prob(x_label, M, log_s)) : dm::nan();
}

// The backward's row reduction term: g * p (softmax) or g (log_softmax).
JAXDET_HD float bwd_term(float g, float p, int32_t mode) { return mode == kSoftmax ? dm::mul(g, p) : g; }

// dx = p * (g - sum(g * p)) (softmax) or g - p * sum(g) (log_softmax).
JAXDET_HD float bwd(float g, float p, float total, int32_t mode) {
  return mode == kSoftmax ? dm::mul(p, dm::sub(g, total)) : dm::sub(g, dm::mul(p, total));
}

// Cross-entropy gradient: g * (p - [i == label]). An out-of-range label: +0 where g == 0 (a masked
// token), NaN otherwise.
JAXDET_HD float xent_bwd_valid(float g, float p, bool is_label) {
  return dm::mul(g, is_label ? dm::sub(p, 1.0f) : p);
}
JAXDET_HD float xent_bwd_invalid(float g) { return g == 0.0f ? 0.0f : dm::nan(); }
JAXDET_HD float xent_bwd(float g, float p, bool is_label, bool valid) {
  return valid ? xent_bwd_valid(g, p, is_label) : xent_bwd_invalid(g);
}

}  // namespace softmax
}  // namespace jaxdet
