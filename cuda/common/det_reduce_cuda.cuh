// Device side of the canonical span reduction of det_math.h, for blocks of detmath::kLanes threads:
// thread t is lane t. Vector loads of a lane's kVec consecutive elements. Shared by the norm and
// softmax kernels.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/det_math.h"

namespace jaxdet {
namespace detmath {

static_assert(kLanes == 256, "the block trees below are written for 256 lanes");

// The pairwise lane tree (lane i adds lane i + s for s = 128, 64, ..., 1, as HostLanes::tree
// does). Every thread gets the root. After one barrier every warp reads the 256 lane values and
// walks the same tree (its lane i holds the nodes i, i + 32, ... of each level, then shuffles),
// so no second barrier is needed to hand out the root. `sh` holds kLanes floats; the function
// starts and ends with a barrier, so `sh` may be reused at once.
__device__ __forceinline__ float block_tree_sum(float v, float* sh) {
  const int t = threadIdx.x, i = t & 31;
  __syncthreads();
  sh[t] = v;
  __syncthreads();
  float a[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = sh[i + 32 * j];
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = add(a[j], a[j + 4]);  // s = 128
#pragma unroll
  for (int j = 0; j < 2; ++j) a[j] = add(a[j], a[j + 2]);  // s = 64
  float r = add(a[0], a[1]);                                // s = 32
#pragma unroll
  for (int s = 16; s >= 1; s >>= 1) r = add(r, __shfl_down_sync(0xFFFFFFFFu, r, s));
  r = __shfl_sync(0xFFFFFFFFu, r, 0);
  __syncthreads();
  return r;
}

// Two independent trees at once (one barrier sequence): the same bits as two block_tree_sum calls.
__device__ __forceinline__ float2 block_tree_sum2(float a, float b, float2* sh) {
  const int t = threadIdx.x;
  __syncthreads();
  sh[t] = make_float2(a, b);
  __syncthreads();
#pragma unroll
  for (int s = 128; s >= 64; s >>= 1) {
    if (t < s) {
      const float2 u = sh[t], w = sh[t + s];
      sh[t] = make_float2(add(u.x, w.x), add(u.y, w.y));
    }
    __syncthreads();
  }
  if (t < 32) {
    float x = add(sh[t].x, sh[t + 32].x);
    float y = add(sh[t].y, sh[t + 32].y);
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) {
      x = add(x, __shfl_down_sync(0xFFFFFFFFu, x, s));
      y = add(y, __shfl_down_sync(0xFFFFFFFFu, y, s));
    }
    if (t == 0) sh[0] = make_float2(x, y);
  }
  __syncthreads();
  return sh[0];
}

// The maximum over the block (detmath::max does not depend on the order). Every thread gets it:
// every warp reduces the warps' maxima itself (one barrier to publish them). Starts and ends with
// a barrier, so `sh` may be reused at once.
__device__ __forceinline__ float block_max(float v, float* sh) {
  const int t = threadIdx.x;
#pragma unroll
  for (int s = 16; s >= 1; s >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, s));
  __syncthreads();
  if ((t & 31) == 0) sh[t >> 5] = v;
  __syncthreads();
  float r = sh[t & (kLanes / 32 - 1)];  // every group of 8 lanes holds the 8 warps' maxima
#pragma unroll
  for (int s = kLanes / 64; s >= 1; s >>= 1) r = max(r, __shfl_xor_sync(0xFFFFFFFFu, r, s));
  __syncthreads();
  return r;
}

// The canonical tree sum (detmath::tree_fold's padded tree with add) over up to 32 leaves held by
// lanes 0 .. count-1 of a warp: at stride s = 1, 2, ..., 16 lane i (a multiple of 2s) adds lane
// i + s when that lane holds a leaf, lower index first. The root is in lane 0. Every lane of the
// warp must call it (shuffles).
__device__ __forceinline__ float warp_tree_sum(float v, int count) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int s = 1; s < 32; s *= 2) {
    const float other = __shfl_down_sync(0xFFFFFFFFu, v, s);
    if ((lane & (2 * s - 1)) == 0 && lane + s < count) v = add(v, other);
  }
  return v;
}

// The canonical tree sum of load(0) .. load(count - 1): by warp_tree_sum when count <= 32 (lane i
// loads leaf i), else walked by lane 0 alone. The result is valid in lane 0. Every lane of the
// warp must call it.
template <typename Load>
__device__ __forceinline__ float warp_tree_sum_of(int64_t count, Load load) {
  const int lane = threadIdx.x & 31;
  if (count <= 32) return warp_tree_sum(lane < count ? load(lane) : load(0), static_cast<int>(count));
  float r = load(0);
  if (lane == 0) r = tree_fold<float>(count, load, [](float a, float b) { return add(a, b); });
  return r;
}

// kVec consecutive storage elements, loaded or stored as one vector when aligned.
template <typename Bits>
struct alignas(kVec * sizeof(Bits)) Vec {
  Bits e[kVec];
};

template <typename Bits>
__device__ __forceinline__ bool vec_aligned(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % sizeof(Vec<Bits>)) == 0;
}

// Loads the kVec elements of a lane at span offset `base` (= step * kStep + lane * kVec) of a span
// of n elements, widened to float; elements past n read as `fill`. `vec` says the span start is
// vector aligned and whole vectors may be read.
template <typename S>
__device__ __forceinline__ void load_lane(const typename S::Bits* __restrict__ p, int64_t base, int64_t n,
                                          bool vec, float fill, float (&out)[kVec]) {
  using Bits = typename S::Bits;
  if (vec && base + kVec <= n) {
    const Vec<Bits> v = *reinterpret_cast<const Vec<Bits>*>(p + base);
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = S::load(v.e[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = base + j < n ? S::load(p[base + j]) : fill;
  }
}

template <typename S>
__device__ __forceinline__ void store_lane(typename S::Bits* __restrict__ p, int64_t base, int64_t n, bool vec,
                                           const float (&in)[kVec]) {
  using Bits = typename S::Bits;
  if (vec && base + kVec <= n) {
    Vec<Bits> v;
#pragma unroll
    for (int j = 0; j < kVec; ++j) v.e[j] = S::store(in[j]);
    *reinterpret_cast<Vec<Bits>*>(p + base) = v;
  } else {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (base + j < n) p[base + j] = S::store(in[j]);
    }
  }
}

}  // namespace detmath
}  // namespace jaxdet
