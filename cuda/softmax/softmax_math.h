// The row statistics and per-element formulas of softmax, log_softmax and cross-entropy, compiled
// for host and device (docs/softmax.md states them; jaxdet/_row_reference.py re-implements them).
//
// A row of n elements is cut into segments of kSegment elements (the last may be short; a row of
// at most kSegment elements is one segment). M = the row's max (order-free, detmath::max). Per
// segment, s = the canonical span sum (det_math.h) of e^(x - M) (every term 0 when M = -inf); the
// segments' sums are combined by the canonical padded tree (detmath::tree_fold) with plain
// addition, giving S; probabilities multiply by its reciprocal. Every other row sum (of g * p, or of g, in the backward) uses the same
// segments and tree. Everything is float32, rounded after every operation. M first and one
// exponential per element (not per-segment maxima merged by rescaling): a kernel that holds a
// segment computes each e^(x - M) once and keeps it for softmax's output.
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

// 1 / S, once per row: every probability is a product with it (a division per element would cost
// the GPU a slow-path branch per element, which keeps it from interleaving the elements' math).
JAXDET_HD float reciprocal(float S) { return dm::div(1.0f, S); }

// p = e^(x - M) * (1 / S): softmax's output before storage rounding, and the probabilities every
// backward uses (inv_s = reciprocal(S)).
JAXDET_HD float prob(float x, float M, float inv_s) { return dm::mul(dm::exp_nonpositive(dm::sub(x, M)), inv_s); }

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
JAXDET_HD float xent_bwd(float g, float p, bool is_label, bool valid) {
  if (!valid) return g == 0.0f ? 0.0f : dm::nan();
  return dm::mul(g, is_label ? dm::sub(p, 1.0f) : p);
}

// The term S sums for element x: e^(x - M) (0 for a row whose max is -inf). x - M is never
// positive (M is the row's max; NaN when the row has one), hence exp_nonpositive.
JAXDET_HD float exp_term(float x, float M) {
  return M == dm::neg_inf() ? 0.0f : dm::exp_nonpositive(dm::sub(x, M));
}

}  // namespace softmax
}  // namespace jaxdet
