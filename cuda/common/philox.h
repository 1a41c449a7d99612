// Philox4x32-10 and the dropout keep rule, compiled for both host (CPU handlers) and device
// (CUDA kernels). Everything a mask bit depends on lives here, so the CPU and GPU targets cannot
// drift apart: one definition, two compilers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JAXDET_HD __host__ __device__ __forceinline__
#else
#define JAXDET_HD inline
#endif

namespace jaxdet {

// Random123 constants (DEShawResearch/random123 include/Random123/philox.h).
constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

struct Philox4 {
  uint32_t v[4];
};

// One widening multiply (a single IMAD.WIDE.U32 on the GPU) gives both halves.
JAXDET_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& lo, uint32_t& hi) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  lo = static_cast<uint32_t>(p);
  hi = static_cast<uint32_t>(p >> 32);
}

// Philox4x32 with 10 rounds: 10 round functions and 9 key bumps (the first round uses the key as
// given). Bit-exact with Random123's philox4x32_R(10, ...) and cuRAND's curand_Philox4x32_10.
JAXDET_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    uint32_t lo0, hi0, lo1, hi1;
    mulhilo32(kPhiloxM0, c0, lo0, hi0);
    mulhilo32(kPhiloxM1, c2, lo1, hi1);
    const uint32_t n0 = hi1 ^ c1 ^ k0;
    const uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The dropout stream. Element with global index g (row-major index inside its key's slice plus
// the user's offset, 64-bit) reads word (g % 4) of the block with counter
//   (lo32(g / 4), hi32(g / 4), 0, 0)
// so one Philox call feeds 4 consecutive elements and the mask is a pure function of (key, g, rate).
JAXDET_HD Philox4 dropout_block(uint64_t block_index, uint32_t k0, uint32_t k1) {
  return philox4x32_10(static_cast<uint32_t>(block_index), static_cast<uint32_t>(block_index >> 32), 0u, 0u, k0,
                       k1);
}

// An element is dropped iff its word is below the threshold round(rate * 2^32) (computed once, on
// the host, in Python). An integer compare keeps the decision exact and identical on every backend.
JAXDET_HD bool dropout_keep(uint32_t word, uint32_t drop_threshold) { return word >= drop_threshold; }

// broadcast_dims: an element's mask index is its row-major index in the shape with the broadcast
// dimensions set to 1. The Python side collapses x's per-key dimensions into alternating runs of
// (size, mask stride), a broadcast run having stride 0, so the index is a dot product.
constexpr int kMaxMaskRank = 16;

struct MaskLayout {
  int rank;
  int64_t dims[kMaxMaskRank];
  int64_t strides[kMaxMaskRank];
};

JAXDET_HD uint64_t mask_index(int64_t element, const MaskLayout& layout) {
  uint64_t index = 0;
  for (int d = layout.rank - 1; d >= 0; --d) {
    const int64_t i = element % layout.dims[d];
    element /= layout.dims[d];
    index += static_cast<uint64_t>(i) * static_cast<uint64_t>(layout.strides[d]);
  }
  return index;
}

JAXDET_HD uint32_t philox_word(const Philox4& r, int lane) {
  return lane == 0 ? r.v[0] : lane == 1 ? r.v[1] : lane == 2 ? r.v[2] : r.v[3];
}

// ---- Storage conversions shared by both backends (round to nearest even, as IEEE specifies). ----

JAXDET_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

JAXDET_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

JAXDET_HD float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

JAXDET_HD uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // the canonical quiet NaN
  const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

JAXDET_HD float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0x1Fu) return f32_from_bits(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return f32_from_bits(sign | ((exp + 112u) << 23) | (mant << 13));
  if (mant == 0) return f32_from_bits(sign);
  // Subnormal half: normalise into a float32 normal.
  uint32_t e = 113u;
  while ((mant & 0x400u) == 0) {
    mant <<= 1;
    --e;
  }
  return f32_from_bits(sign | (e << 23) | ((mant & 0x3FFu) << 13));
}

JAXDET_HD uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return 0x7E00u;  // the canonical quiet NaN
  if (abs >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 2^16: inf
  if (abs >= 0x38800000u) {  // normal half range
    const uint32_t rounded = abs + 0x0FFFu + ((abs >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
  }
  if (abs < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
  // Subnormal half: shift the full significand into place, rounding to nearest even.
  const uint32_t exp = abs >> 23;
  const uint32_t mant = (abs & 0x7FFFFFu) | 0x800000u;
  const uint32_t shift = 126u - exp;  // 14..24
  const uint32_t half = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u);
  const uint32_t halfway = 1u << (shift - 1u);
  const uint32_t round_up = (rest > halfway) || (rest == halfway && (half & 1u));
  return static_cast<uint16_t>(sign | (half + round_up));
}

// Storage type tags. Loads widen exactly; stores round to nearest even. A NaN result is stored as
// the canonical quiet NaN (0x7FC00000, 0x7FC0, 0x7E00: what jnp.nan is), never as whatever payload
// a backend's arithmetic left, so NaN bits cannot make the CPU and GPU differ (NVIDIA arithmetic
// returns 0x7FFFFFFF, x86 keeps the operand's payload). On the device the hardware conversion
// instructions are used for finite values; on the host the bit-exact software versions above.
struct F32Storage {
  using Bits = uint32_t;
  static constexpr Bits kCanonicalNaN = 0x7FC00000u;
  JAXDET_HD static float load(Bits b) { return f32_from_bits(b); }
  JAXDET_HD static Bits store(float f) { return f != f ? kCanonicalNaN : f32_bits(f); }
};
struct BF16Storage {
  using Bits = uint16_t;
  static constexpr Bits kCanonicalNaN = 0x7FC0u;
  JAXDET_HD static float load(Bits b) { return bf16_to_f32(b); }
  JAXDET_HD static Bits store(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    uint16_t r;  // the hardware rounds finite values like f32_to_bf16, but writes NaN as 0x7FFF
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return f != f ? kCanonicalNaN : r;
#else
    return f32_to_bf16(f);
#endif
  }
};
struct F16Storage {
  using Bits = uint16_t;
  static constexpr Bits kCanonicalNaN = 0x7E00u;
  JAXDET_HD static float load(Bits b) {
#if defined(__CUDA_ARCH__)
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(b));
    return f;
#else
    return f16_to_f32(b);
#endif
  }
  JAXDET_HD static Bits store(float f) {
#if defined(__CUDA_ARCH__)
    uint16_t r;  // the hardware rounds finite values like f32_to_f16, but writes NaN as 0x7FFF
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return f != f ? kCanonicalNaN : r;
#else
    return f32_to_f16(f);
#endif
  }
};

// The kept value: the input widened to float32, times float32(1 / (1 - rate)) rounded once
// (explicitly, so no compiler may fuse it into something else), stored back to the input dtype.
// A dropped element is +0 whatever it held (a NaN there gives 0, as flax's select does).
// Written without branches (both sides are computed, then selected) so the GPU runs it as
// straight-line code.
template <typename Storage>
JAXDET_HD typename Storage::Bits dropout_element(typename Storage::Bits x, bool keep, float scale) {
  using Bits = typename Storage::Bits;
#if defined(__CUDA_ARCH__)
  const float y = __fmul_rn(Storage::load(x), scale);
#else
  const float y = Storage::load(x) * scale;
#endif
  const Bits stored = Storage::store(y);
  return keep ? stored : Bits{0};
}

}  // namespace jaxdet
