// The canonical order of jaxdet.attention (docs/attention.md), the parts of it that are the same
// on every backend: the KV block and split sizes, the online-softmax update of a block, the merge
// of a split into the running total, the final division, and exp2/log2 made of IEEE additions and
// multiplications only (so the CPU results do not depend on the C library, and a GPU kernel that
// calls them computes the same bits as the CPU).
//
// Per query row, with c = float32(scale * log2(e)) and x_j = float32(s_j * c) for the row's
// visible keys j (positions 0 .. limit-1 of its own sequence):
//   keys are cut into blocks of kBlock positions from position 0, blocks into splits of kSplit;
//   each split runs the online softmax over its blocks in ascending order from a fresh state
//   (m = -inf, l = 0, acc = 0) with block_update; the splits are merged into a running total in
//   ascending order with merge; the output is acc * (1 / l), rounded once to the output dtype.
// A block or split with no visible key for a row leaves its state unchanged (the guards below),
// so processing it or skipping it gives the same bits.
#pragma once

#include <cstdint>

#include "common/det_math.h"  // the correctly rounded operations (dm::add ...)
#include "common/philox.h"    // JAXDET_HD, f32 bit casts, storage tags

namespace jaxdet {
namespace attn {

namespace dm = ::jaxdet::detmath;

constexpr int kBlock = 64;                     // KV positions per block (online-softmax step)
constexpr int kSplit = 512;                    // KV positions per split (unit of decode parallelism)
constexpr int kBlocksPerSplit = kSplit / kBlock;
static_assert(kSplit % kBlock == 0, "a split is a whole number of blocks");

JAXDET_HD float f_floor(float x) {
#if defined(__CUDA_ARCH__)
  return floorf(x);
#else
  return __builtin_floorf(x);
#endif
}

// The running max: a NaN wins (so a NaN score reaches the output even when it is the only one),
// otherwise the larger value. Exact, so the order of a max reduction does not matter.
JAXDET_HD float max_nan(float m, float x) { return (x != x || x > m) ? x : m; }

// 2^x. Range reduction x = n + f with n = floor(x + 0.5) (f = x - n is exact, |f| <= 0.5), a
// degree-7 Taylor polynomial of 2^f = e^(f ln 2) in Horner form (relative truncation error below
// 2^-27), then an exact scaling by 2^n (two steps below 2^-125, so a subnormal result is rounded
// once). Every operation is an IEEE float32 add or multiply rounded to nearest even.
JAXDET_HD float exp2_canonical(float x) {
  if (x != x) return x;
  if (x < -151.0f) return 0.0f;  // 2^x < 2^-150 rounds to +0; also x = -inf
  if (x > 128.0f) return f32_from_bits(0x7F800000u);
  const float n = f_floor(dm::add(x, 0.5f));
  const float f = dm::sub(x, n);
  // ln(2)^k / k!, rounded to float32.
  constexpr float c1 = 0.693147180559945309f, c2 = 0.240226506959100712f, c3 = 0.0555041086648215800f,
                  c4 = 0.00961812910762847717f, c5 = 0.00133335581464284434f, c6 = 1.54035303933816099e-4f,
                  c7 = 1.52527338040598403e-5f;
  float p = c7;
  p = dm::add(dm::mul(p, f), c6);
  p = dm::add(dm::mul(p, f), c5);
  p = dm::add(dm::mul(p, f), c4);
  p = dm::add(dm::mul(p, f), c3);
  p = dm::add(dm::mul(p, f), c2);
  p = dm::add(dm::mul(p, f), c1);
  p = dm::add(dm::mul(p, f), 1.0f);
  int e = static_cast<int>(n);
  if (e >= -125) {
    if (e > 127) {  // p * 2^128 with p < 1 (x <= 128): two exact steps
      p = dm::mul(p, 2.0f);
      e -= 1;
    }
    return dm::mul(p, f32_from_bits(static_cast<uint32_t>(e + 127) << 23));
  }
  p = dm::mul(p, f32_from_bits(static_cast<uint32_t>(e + 100 + 127) << 23));  // exact
  return dm::mul(p, f32_from_bits(static_cast<uint32_t>(-100 + 127) << 23));  // one rounding
}

// log2(x) for the row sums (x >= 1 in practice; any positive float is handled). x = 2^e * m with
// m in [sqrt(1/2), sqrt(2)); log2(m) = (2 / ln 2) * atanh(t), t = (m - 1) / (m + 1), by its odd
// series to t^11 (|t| < 0.172: truncation below 2^-30).
JAXDET_HD float log2_canonical(float x) {
  if (x != x || x < 0.0f) return f32_from_bits(0x7FC00000u);
  if (x == 0.0f) return dm::neg_inf();
  uint32_t u = f32_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u) return x;  // +inf
  int e = 0;
  if ((u & 0x7F800000u) == 0) {  // subnormal: scale by 2^32 (exact)
    x = dm::mul(x, 4294967296.0f);
    u = f32_bits(x);
    e = -32;
  }
  e += static_cast<int>((u >> 23) & 0xFFu) - 127;
  float m = f32_from_bits((u & 0x007FFFFFu) | 0x3F800000u);  // [1, 2)
  if (m > 1.41421356f) {
    m = dm::mul(m, 0.5f);
    e += 1;
  }
  const float t = dm::div(dm::sub(m, 1.0f), dm::add(m, 1.0f));
  const float t2 = dm::mul(t, t);
  float s = 1.0f / 11.0f;
  s = dm::add(dm::mul(s, t2), 1.0f / 9.0f);
  s = dm::add(dm::mul(s, t2), 1.0f / 7.0f);
  s = dm::add(dm::mul(s, t2), 1.0f / 5.0f);
  s = dm::add(dm::mul(s, t2), 1.0f / 3.0f);
  s = dm::add(dm::mul(s, t2), 1.0f);
  const float two_over_ln2 = 2.88539008177792681f;
  return dm::add(static_cast<float>(e), dm::mul(dm::mul(s, t), two_over_ln2));
}

// The scale factors of one online-softmax step (block_update) or merge. m_new = max(m_old, m_in):
//   - m_new == -inf (nothing visible on either side): the caller leaves its state unchanged;
//   - otherwise old state is scaled by exp2(m_old - m_new) (0 when m_old == -inf) and the new
//     terms by exp2(m_in - m_new) (merge only; a block's terms are exp2(x_j - m_new) each).
struct Rescale {
  float m_new;
  float old_scale;
  float in_scale;
  bool empty;
};

template <class Math>
JAXDET_HD Rescale rescale(float m_old, float m_in) {
  Rescale r;
  r.m_new = max_nan(m_old, m_in);
  r.empty = r.m_new == dm::neg_inf();
  r.old_scale = r.empty ? 1.0f : Math::exp2(dm::sub(m_old, r.m_new));
  r.in_scale = r.empty ? 0.0f : Math::exp2(dm::sub(m_in, r.m_new));
  return r;
}

// A split whose max is -inf saw no key of this row: it is skipped, never merged.
JAXDET_HD bool split_is_empty(float m_split) { return m_split == dm::neg_inf(); }

// Merge of a split (m_s, l_s, acc_s) into the running total (m, l, acc), one column at a time:
//   l = l * a + l_s * b,  acc = acc * a + acc_s * b,  a = exp2(m - m'), b = exp2(m_s - m'),
// each product and the sum rounded separately (no fused multiply-add).
JAXDET_HD float merge_term(float total, float a, float part, float b) {
  return dm::add(dm::mul(total, a), dm::mul(part, b));
}

// The end of a row: out = acc * (1 / l), the reciprocal rounded once per row (out_scale) so that
// a row's D outputs cost one division, and the log-sum-exp in base 2, lse2 = m + log2(l), which the
// backward uses to recompute probabilities p_j = exp2(x_j - lse2). A row with no visible key has
// l == 0 and acc == 0: out = 0 and lse2 = -inf (a NaN l stays NaN).
JAXDET_HD float out_scale(float l) { return l == 0.0f ? 0.0f : dm::div(1.0f, l); }
JAXDET_HD float finish_out(float acc, float inv_l) { return dm::mul(acc, inv_l); }

template <class Math>
JAXDET_HD float finish_lse2(float m, float l) {
  return l == 0.0f ? dm::neg_inf() : dm::add(m, Math::log2(l));
}

// The transcendental functions of the CPU and of the GPU's float32 (SIMT) kernels.
struct CanonicalMath {
  JAXDET_HD static float exp2(float x) { return exp2_canonical(x); }
  JAXDET_HD static float log2(float x) { return log2_canonical(x); }
};

}  // namespace attn
}  // namespace jaxdet
