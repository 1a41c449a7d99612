// The canonical reduction order of jaxdet's global-norm clipping, compiled for both host (CPU
// handler) and device (CUDA kernels). Every rounding that the norm, the scale or a clipped element
// depends on is one of the functions below, so the two backends do the same IEEE operations in the
// same order (docs/clipping.md states the order; tests/test_clip.py re-implements it in NumPy).
//
//   1. Each leaf is cut into chunks of kChunk = 4096 elements (row-major; the last chunk of a leaf
//      may be short; chunks never span leaves; empty leaves have no chunk). Chunks are numbered
//      leaf by leaf, in the order the leaves are given (jax.tree flatten order).
//   2. Inside a chunk, element e belongs to lane (e % 1024) / 4 of kLanes = 256 lanes. Each lane
//      accumulates, in float32 starting from +0, the squares of its elements in increasing e
//      (k = e / 1024 outer, j = e % 4 inner): acc = acc + x*x, each * and + rounded (RNE).
//      Elements past the end of the leaf are skipped.
//   3. The 256 lane sums are combined by a fixed pairwise tree: for s = 128, 64, ..., 1:
//      v[i] = v[i] + v[i + s] (i < s). v[0] is the chunk's partial (float32) in slot[chunk].
//   4. The N slots are reduced in float64: lane r of kFinalLanes = 1024 adds slot r, r + 1024,
//      r + 2048, ... in that order (starting from +0.0), then a pairwise tree over the 1024 lanes
//      (s = 512 ... 1). norm = float32(sqrt(total)) (sqrt in float64, both roundings RNE).
//   5. The scale (clip_decision) and the per-element multiply (clip_element) below.
// NaN results are canonicalised (0x7FC00000 before storage rounding) so NaN bits cannot depend on
// which backend propagated which payload.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/det_math.h"  // the correctly rounded float32 operations, is_nan, canonical
#include "common/philox.h"    // JAXDET_HD, storage tags and RNE conversions

namespace jaxdet {
namespace clip {

namespace dm = ::jaxdet::detmath;

constexpr int kChunk = 4096;       // elements per chunk
constexpr int kLanes = 256;        // lanes per chunk (== CUDA threads per block of pass 1 and 3)
constexpr int kVec = 4;            // consecutive elements a lane takes per step
constexpr int kSteps = kChunk / (kLanes * kVec);  // 4
constexpr int kFinalLanes = 1024;  // lanes of the float64 reduction over chunk slots

// What pass 3 does with every element.
enum Mode : uint32_t {
  kIdentity = 0,  // scale == 1: every element keeps its exact bits
  kMultiply = 1,  // y = dtype(float32(x) * scale)
  kZero = 2,      // nonfinite="skip" and the norm is not finite: y = +0
};

// nonfinite policies (the FFI attribute "nonfinite").
enum Policy : int32_t {
  kPropagate = 0,
  kSkip = 1,
};

JAXDET_HD double d_add(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

JAXDET_HD float d_sqrt_to_f32(double a) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(__dsqrt_rn(a));
#else
  return static_cast<float>(std::sqrt(a));
#endif
}

JAXDET_HD bool is_finite(float x) { return (f32_bits(x) & 0x7F800000u) != 0x7F800000u; }
JAXDET_HD bool is_pos_inf(float x) { return f32_bits(x) == 0x7F800000u; }

// Step 2: one lane's contribution of one element.
JAXDET_HD float accumulate_square(float acc, float x) { return dm::add(acc, dm::mul(x, x)); }

// Step 4's end: the float64 total of squares to the float32 norm.
JAXDET_HD float norm_from_total(double total) { return dm::canonical(d_sqrt_to_f32(total)); }

struct Decision {
  uint32_t mode;
  float scale;  // meaningful for kMultiply
};

// Step 5: scale = min(1, max_norm / norm) with the edge cases pinned down:
//   * norm <= max_norm (so norm == 0, and 0/0 never happens) or max_norm == +inf: identity;
//   * a non-finite norm with nonfinite == kSkip: every element becomes +0;
//   * otherwise scale = max_norm / norm rounded once (a NaN norm gives a NaN scale, an inf norm a
//     0 scale: optax's results); a scale that rounds to exactly 1 is the identity.
// A negative max_norm (possible only when traced) acts as 0; a NaN max_norm gives a NaN scale.
JAXDET_HD Decision clip_decision(float norm, float max_norm, int32_t policy) {
  if (policy == kSkip && !is_finite(norm)) return Decision{kZero, 0.0f};
  if (is_pos_inf(max_norm)) return Decision{kIdentity, 1.0f};
  if (!dm::is_nan(max_norm) && max_norm < 0.0f) max_norm = 0.0f;
  if (norm <= max_norm) return Decision{kIdentity, 1.0f};
  const float scale = dm::canonical(dm::div(max_norm, norm));
  if (scale == 1.0f) return Decision{kIdentity, 1.0f};
  return Decision{kMultiply, scale};
}

// Step 5, per element (kMultiply): widen to float32, one rounded multiply, canonical NaN, one
// rounding to the storage dtype.
template <typename Storage>
JAXDET_HD typename Storage::Bits clip_element(typename Storage::Bits x, float scale) {
  return Storage::store(dm::canonical(dm::mul(Storage::load(x), scale)));
}

}  // namespace clip
}  // namespace jaxdet
