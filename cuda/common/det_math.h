// Deterministic float32 math and the canonical row-reduction order, compiled for both host (CPU
// handlers) and device (CUDA kernels), so the two backends do the same IEEE operations in the same
// order and produce the same bits (docs/norm.md, docs/softmax.md).
//
// Every operation below is a single correctly rounded IEEE-754 binary32 +, -, *, / or sqrt (round
// to nearest even). On the device they are the explicit __f*_rn intrinsics, which nvcc never fuses
// into an FMA; on the host the build uses -ffp-contract=off. exp and log are polynomial
// approximations written with those operations only (no libm, no hardware approximation), so
// they too give the same bits everywhere. Subnormals are IEEE on both sides: the CUDA code is built
// without -ftz and the CPU handlers run inside IeeeSubnormalsScope (ffi_common.h).
//
// The canonical order of a reduction over a span of n elements (a norm's row, or one segment of a
// softmax row): element e (0-based in the span) belongs to lane (e / kVec) % kLanes; each lane
// folds its elements in increasing e, in float32, starting from +0; then the kLanes lane values are
// combined by the pairwise tree  for s = kLanes/2, ..., 1: v[i] = v[i] + v[i + s] (i < s).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/philox.h"  // JAXDET_HD, f32_bits / f32_from_bits, storage tags

namespace jaxdet {
namespace detmath {

constexpr int kLanes = 256;               // lanes of the canonical span reduction (CUDA threads of a row block)
constexpr int kVec = 4;                   // consecutive elements a lane takes per step
constexpr int kStep = kLanes * kVec;      // elements per step (1024)
constexpr uint32_t kCanonicalNanBits = 0x7FC00000u;

// ---- Correctly rounded operations (never contracted into an FMA). ----

JAXDET_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

JAXDET_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

JAXDET_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

JAXDET_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// a * b + c with one rounding (IEEE fusedMultiplyAdd): correctly rounded on both sides, so the
// same bits (std::fmaf is the C library's correctly rounded fma, whatever the CPU).
JAXDET_HD float fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fmaf(a, b, c);
#endif
}

JAXDET_HD float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

JAXDET_HD bool is_nan(float x) { return x != x; }  // (the builds never assume finite math)
JAXDET_HD float nan() { return f32_from_bits(kCanonicalNanBits); }
JAXDET_HD float canonical(float x) { return is_nan(x) ? nan() : x; }
JAXDET_HD float pos_inf() { return f32_from_bits(0x7F800000u); }
JAXDET_HD float neg_inf() { return f32_from_bits(0xFF800000u); }

// 1 / sqrt(a), two correctly rounded operations.
JAXDET_HD float rsqrt(float a) { return div(1.0f, sqrt(a)); }

// The maximum as a function of the set of values, whatever the order it is taken in: NaN if either
// is NaN (canonical), and max(+0, -0) = +0 (for equal values the AND of the bits keeps the sign
// only if both are negative). So any reduction order gives the same bits. Written with selects, no
// branches, so that a device thread interleaves the elements it holds.
JAXDET_HD float max(float a, float b) {
  const float larger = a > b ? a : b;
  const float m = a == b ? f32_from_bits(f32_bits(a) & f32_bits(b)) : larger;
  return is_nan(a) || is_nan(b) ? nan() : m;
}

// 2^k for -126 <= k <= 127, exactly.
JAXDET_HD float pow2(int k) { return f32_from_bits(static_cast<uint32_t>(k + 127) << 23); }

// e^x for x in [-112, 89]. Range reduction x = k ln2 + r with k = nearest integer to x * log2(e)
// and |r| <= ~ln2/2 (Cody-Waite: x - k * kLn2Hi is exact by Sterbenz, then k * kLn2Lo subtracted
// in one fused multiply-add); e^r by its Taylor polynomial of degree 7 in Horner form with fused
// multiply-adds (truncation below 0.1 ulp); then the scale 2^k applied as two multiplies by 2^k1
// and 2^(k - k1), k1 = floor(k / 2): the first exact, the second rounding once (into the subnormal
// range, or to inf, when the result is there). Below -104 every result rounds to +0 (e^-104 is
// 0.97 * 2^-150), so a clamp at -112 needs no select of its own. Written without branches, so
// that a device thread interleaves the exponentials of the elements it holds.
JAXDET_HD float exp_clamped(float x) {
  constexpr float kLog2e = 0x1.715476p+0f;  // float32(log2(e))
  constexpr float kShift = 12582912.0f;     // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kLn2Hi = 0.693145751953125f;  // 0x3F317200: 15 significant bits
  constexpr float kLn2Lo = 0x1.7f7d1cp-20f;     // float32(ln2 - kLn2Hi)
  const float shifted = fma(x, kLog2e, kShift);  // 1.5 * 2^23 + k: its low bits hold k
  const float kf = sub(shifted, kShift);         // k, an integer in [-162, 128]
  const float r = fma(-kf, kLn2Lo, fma(-kf, kLn2Hi, x));  // the inner one exact (Sterbenz)
  float p = 0x1.a01a02p-13f;  // float32(1/k!), k = 7 ... 2
  p = fma(p, r, 0x1.6c16c2p-10f);
  p = fma(p, r, 0x1.111112p-7f);
  p = fma(p, r, 0x1.555556p-5f);
  p = fma(p, r, 0x1.555556p-3f);
  p = fma(p, r, 0.5f);
  p = fma(p, r, 1.0f);
  p = fma(p, r, 1.0f);
  // k from the bits (the float-to-int conversion would be a quarter-rate instruction on the GPU).
  const int k = static_cast<int>(f32_bits(shifted)) - static_cast<int>(f32_bits(kShift));
  const int k1 = k >> 1;  // floor(k / 2): k1, k - k1 in [-81, 64]
  // p is in [0.70, 1.42]: p * 2^k1 is a normal float, exact (so the product's one rounding is the
  // second multiply's, whichever split of k).
  return mul(mul(p, pow2(k1)), pow2(k - k1));
}

// e^x: x > 89 gives +inf (e^89 > FLT_MAX), x < -104 gives +0 (e^-104 < 2^-150), NaN gives NaN.
// Max error measured over a stride through all float32 inputs:
// tests/test_softmax.py::test_exp_and_log_error_vs_float64.
JAXDET_HD float exp(float x) {
  const float e = exp_clamped(fminf(fmaxf(x, -112.0f), 89.0f));  // (NaN -> -112: selected below)
  return is_nan(x) ? nan() : x > 89.0f ? pos_inf() : e;
}

// exp(x) for x <= 0 or NaN, bit for bit, without the overflow test (softmax's x - M).
JAXDET_HD float exp_nonpositive(float x) {
  const float e = exp_clamped(fmaxf(x, -112.0f));
  return is_nan(x) ? nan() : e;
}

// ln(x). x = 2^e * m with m in [sqrt(1/2), sqrt(2)) (subnormals are first scaled by 2^23, exactly);
// f = m - 1 (exact); ln(1 + f) = f - hfsq + s * (hfsq + R) with hfsq = f*f/2, s = f / (2 + f) and
// R = 2z/3 + 2z^2/5 + 2z^3/7 + 2z^4/9, z = s*s (the series of 2 atanh(s) - 2s; truncation below
// 1e-8 relative); e * ln2 is added as an exact e * kLn2Hi plus e * kLn2Lo folded into the small
// terms. ln(+-0) = -inf, ln(x < 0) = NaN, ln(+inf) = +inf, NaN -> NaN (canonical).
JAXDET_HD float log(float x) {
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 0x1.7f7d1cp-20f;
  constexpr uint32_t kSqrt2Bits = 0x3FB504F3u;  // float32(sqrt(2)), rounded down
  uint32_t u = f32_bits(x);
  if (is_nan(x)) return nan();
  if ((u & 0x7FFFFFFFu) == 0) return neg_inf();
  if (u & 0x80000000u) return nan();
  if (u == 0x7F800000u) return pos_inf();
  int e = 0;
  if (u < 0x00800000u) {  // subnormal: scale into the normal range
    u = f32_bits(mul(x, 8388608.0f));
    e = -23;
  }
  e += static_cast<int>(u >> 23) - 127;
  uint32_t mbits = (u & 0x007FFFFFu) | 0x3F800000u;  // m in [1, 2)
  if (mbits > kSqrt2Bits) {
    mbits -= 0x00800000u;  // m / 2, exactly
    e += 1;
  }
  const float f = sub(f32_from_bits(mbits), 1.0f);
  const float hfsq = mul(0.5f, mul(f, f));
  const float s = div(f, add(2.0f, f));
  const float z = mul(s, s);
  float R = 0x1.c71c72p-3f;  // float32(2/k), k = 9, 7, 5, 3
  R = add(mul(R, z), 0x1.24924ap-2f);
  R = add(mul(R, z), 0x1.99999ap-2f);
  R = add(mul(R, z), 0x1.555556p-1f);
  R = mul(R, z);
  const float dk = static_cast<float>(e);
  const float lo = add(mul(s, add(hfsq, R)), mul(dk, kLn2Lo));
  return sub(mul(dk, kLn2Hi), sub(sub(hfsq, lo), f));
}

// ---- The canonical tree over a sequence of partial results (softmax segments, parameter-gradient
// blocks): the balanced binary tree over the sequence padded to a power of two with absent leaves,
// lower index first; a node whose right half is absent equals its left half (jaxdet.parallel's
// tree_sum). Walked left to right with a stack of complete subtrees (a binary counter): a new leaf
// merges with equal-sized subtrees on the stack; at the end the stack folds from the top, which is
// the padded tree's right spine. `Combine(left, right)` is the node's operation. ----

template <typename T, typename Load, typename Combine>
JAXDET_HD T tree_fold(int64_t n, Load load, Combine combine) {
  T stack[64];
  int64_t size[64];
  int top = 0;
  for (int64_t i = 0; i < n; ++i) {
    T node = load(i);
    int64_t count = 1;
    while (top > 0 && size[top - 1] == count) {
      node = combine(stack[top - 1], node);
      count *= 2;
      --top;
    }
    stack[top] = node;
    size[top] = count;
    ++top;
  }
  T acc = stack[top - 1];
  for (int j = top - 2; j >= 0; --j) acc = combine(stack[j], acc);
  return acc;
}

// ---- Host emulation of the canonical span reduction (the CPU handlers). ----

// Lane accumulators of one span reduction; add(e, v) is the fold of element e's term v.
struct HostLanes {
  float v[kLanes];
  HostLanes() {
    for (float& x : v) x = 0.0f;
  }
  void add_term(int64_t e, float term) {
    float& a = v[(e / kVec) % kLanes];
    a = detmath::add(a, term);
  }
  float tree() {
    for (int s = kLanes / 2; s >= 1; s >>= 1) {
      for (int i = 0; i < s; ++i) v[i] = detmath::add(v[i], v[i + s]);
    }
    return v[0];
  }
};

}  // namespace detmath
}  // namespace jaxdet
