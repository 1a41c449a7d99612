// The per-row and per-element formulas of RMSNorm and LayerNorm, compiled for host and device
// (docs/norm.md states them; jaxdet/_row_reference.py re-implements them in NumPy). Rows reduce in
// the canonical span order of common/det_math.h; everything is float32, rounded after every
// operation. "center" selects LayerNorm (mean subtracted) over RMSNorm (mean = +0, and x - (+0) is
// x bit for bit, so one formula serves both).
#pragma once

#include <cstdint>

#include "common/det_math.h"

namespace jaxdet {
namespace norm {

namespace dm = ::jaxdet::detmath;

// Tokens per partial of the parameter-gradient tree: each kernel block reduces an aligned run of
// kGradBlock tokens by the canonical tree (a complete subtree, or the padded tail), and the
// partials are combined by the upper levels of the same tree. An implementation constant, not part
// of the contract (the contract is the tree over tokens).
constexpr int kGradBlock = 32;

// Rows of partials the CUDA kernels keep between the levels of the tree over T tokens: ceil(T / 32)
// after the first level, ceil of that / 32 after the next, ..., every level but the last (one).
JAXDET_HD int64_t grad_workspace_rows(int64_t tokens) {
  int64_t rows = 0;
  for (int64_t count = (tokens + kGradBlock - 1) / kGradBlock; count > 1;
       count = (count + kGradBlock - 1) / kGradBlock) {
    rows += count;
  }
  return rows;
}

JAXDET_HD float to_float(int64_t n) { return static_cast<float>(n); }

// mean = sum / n (LayerNorm only).
JAXDET_HD float mean_of(float sum, int64_t n) { return dm::div(sum, to_float(n)); }

// The term of the second reduction: (x - mean)^2.
JAXDET_HD float centered_square(float x, float mean) {
  const float d = dm::sub(x, mean);
  return dm::mul(d, d);
}

// rstd = 1 / sqrt(sum_sq / n + eps).
JAXDET_HD float rstd_of(float sum_sq, int64_t n, float eps) {
  return dm::rsqrt(dm::add(dm::div(sum_sq, to_float(n)), eps));
}

JAXDET_HD float normalized(float x, float mean, float rstd) { return dm::mul(dm::sub(x, mean), rstd); }

// y = xhat * w (+ b).
JAXDET_HD float forward(float x, float mean, float rstd, float w, float b, bool has_bias) {
  const float yw = dm::mul(normalized(x, mean, rstd), w);
  return has_bias ? dm::add(yw, b) : yw;
}

// The backward's row reductions: sum of gw (LayerNorm) and sum of gw * xhat, gw = g * w.
JAXDET_HD float grad_scaled(float g, float w) { return dm::mul(g, w); }

// dx = rstd * ((gw - xhat * mb) - ma) with ma = sum(gw) / n, mb = sum(gw * xhat) / n; RMSNorm has
// no ma term.
JAXDET_HD float backward_from(float xhat, float gw, float rstd, float ma, float mb, bool center) {
  const float t = dm::sub(gw, dm::mul(xhat, mb));
  return dm::mul(rstd, center ? dm::sub(t, ma) : t);
}

JAXDET_HD float backward(float x, float g, float w, float mean, float rstd, float ma, float mb, bool center) {
  return backward_from(normalized(x, mean, rstd), grad_scaled(g, w), rstd, ma, mb, center);
}

// Parameter-gradient terms of one token: dscale = g * xhat, dbias = g.
JAXDET_HD float scale_grad_term(float x, float g, float mean, float rstd) {
  return dm::mul(g, normalized(x, mean, rstd));
}

// The canonical tree over v[0 .. m) (m <= kGradBlock) in place: at stride s = 1, 2, 4, ... the
// node at i (a multiple of 2s) covers leaves [i, i + 2s) and is v[i] + v[i + s] when its right
// half holds a leaf (i + s < m), else v[i] (an absent right half). Constant trip counts, so v
// stays in registers on the device. Returns the root.
JAXDET_HD float block_tree(float (&v)[kGradBlock], int m) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int s = 1; s < kGradBlock; s *= 2) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < kGradBlock; i += 2 * s) {
      if (i + s < m) v[i] = dm::add(v[i], v[i + s]);
    }
  }
  return v[0];
}

}  // namespace norm
}  // namespace jaxdet
