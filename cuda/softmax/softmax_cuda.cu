// CUDA targets of softmax, log_softmax and cross-entropy. A 256-thread block works on one segment
// of one row at a time (thread t is lane t of the canonical span order), so a row's bits depend on
// that row only, never on the number of rows or the launch grid. Each segment is reduced against
// its own max (softmax_math.h), so a block needs no other block's result before its exponentials.
//
//   rows of one segment (n <= 8192): one fused kernel per call; the row is held in registers, so
//     x is read once (forward) or x and g once (backward).
//   softmax / log_softmax, rows of 2 to 16 segments on GPUs with thread block clusters (Hopper and
//     later): one cluster per row, block r holding segment r in registers; the segments' maxima
//     and sums reach every block's shared memory (Slots, one exchange per row), where every block
//     combines them by the same tree. x is read once and e^(x - m) computed once per element.
//     The cross-entropy too when its rows fit in one wave of clusters (one launch).
//   cross-entropy, more rows of several segments: every (row, segment) reduced independently into
//     the workspace (no block waits for another), then one warp per row combines its segments.
//   other rows of several segments: the same, then the outputs (x read twice); in the backward,
//     partial sums, then the outputs.
//   backward of rows of 2 to 16 segments with clusters: block r holds segment r of x and g; the
//     segments' partial sums reach every block (Slots).
//
// Layouts as in softmax_cpu.cc (stats float32 [R, stat_width(n)]); the workspace is float32 [R,
// segments, 2] (forward) or [R, segments] (backward) when rows have several segments, else empty.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "common/cuda_common.h"
#include "common/det_math.h"
#include "common/det_reduce_cuda.cuh"
#include "common/testing.h"
#include "softmax/softmax_ffi.h"
#include "softmax/softmax_math.h"

namespace jaxdet {
namespace {

namespace cg = ::cooperative_groups;
namespace dm = ::jaxdet::detmath;
namespace sm = ::jaxdet::softmax;

using dm::kLanes;
using dm::kStep;
using dm::kVec;

// The heavy kernels keep a segment (or a segment of x and of g) in registers; three resident blocks
// per SM (<= 80 registers) keep more loads in flight than the two that 128 registers would allow.
constexpr int kMinBlocks = 3;

// The most segments a row may have to run as one cluster (16 blocks: a non-portable cluster size,
// which Hopper allows).
constexpr int kMaxClusterSegments = 16;

// Loads the lane's elements of a span of `len` elements (NaN-free fill, masked by the callers).
template <typename S, int kSteps>
__device__ __forceinline__ void load_span(const typename S::Bits* __restrict__ p, int64_t len, bool vec,
                                          float (&v)[kSteps][kVec]) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k) dm::load_lane<S>(p, k * kStep + threadIdx.x * kVec, len, vec, 0.0f, v[k]);
}

// The lane's vectors of a span of `len` storage elements, kept in storage form (a bfloat16/float16
// cotangent then takes half the registers; it widens exactly at each use). Elements past len read
// as +0 (masked by the callers).
template <typename Bits, int kSteps>
__device__ __forceinline__ void load_span_vecs(const Bits* __restrict__ p, int64_t len, bool vec,
                                               dm::Vec<Bits> (&b)[kSteps]) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int64_t base = k * kStep + threadIdx.x * kVec;
    if (vec && base + kVec <= len) {
      b[k] = *reinterpret_cast<const dm::Vec<Bits>*>(p + base);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) b[k].e[j] = base + j < len ? p[base + j] : Bits{0};
    }
  }
}

// (A span has at most kSegment elements: int arithmetic.)
__device__ __forceinline__ bool in_span(int k, int j, int64_t len) {
  return k * kStep + static_cast<int>(threadIdx.x) * kVec + j < static_cast<int>(len);
}

// f(k, j, inside) for every element v[k][j] a lane holds, `inside` telling whether it lies in the
// span of len elements. A full span (every lane holds kSteps * kVec elements: all but a row's
// last segment) passes the constant true, so its loop runs without per-element masks.
template <int kSteps, typename F>
__device__ __forceinline__ void for_lane_elements(int64_t len, F f) {
  if (len == kSteps * kStep) {
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(k, j, true);
    }
  } else {
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) f(k, j, in_span(k, j, len));
    }
  }
}

// The maximum of the span held in v (len elements), as detmath::max defines it. Every thread gets
// it. A NaN-propagating maximum (one instruction) finds the value; only a zero maximum, whose sign
// that instruction may get wrong, is settled by the exact walk.
template <int kSteps, typename Value>
__device__ __forceinline__ float span_max_of(Value value, int64_t len, float* sh) {
  float m = dm::neg_inf();
  for_lane_elements<kSteps>(len, [&](int k, int j, bool inside) {
    if (inside) m = fmax_nan(m, value(k, j));
  });
  if (__syncthreads_or(m != m)) return dm::nan();
  m = dm::block_max(m, sh);
  if (m != 0.0f) return m;
  float exact = dm::neg_inf();  // (rare: one masked loop)
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      if (in_span(k, j, len)) exact = dm::max(exact, value(k, j));
    }
  }
  return dm::block_max(exact, sh);
}

template <int kSteps>
__device__ __forceinline__ float span_max(const float (&v)[kSteps][kVec], int64_t len, float* sh) {
  return span_max_of<kSteps>([&](int k, int j) { return v[k][j]; }, len, sh);
}

// The span's sum of the terms e^(value(k, j) - M) (sm::exp_term), each also handed to keep(k, j, e).
// Every thread gets the sum.
template <int kSteps, typename Value, typename Keep>
__device__ __forceinline__ float span_exp_sum_kept(Value value, Keep keep, int64_t len, float M, float* sh) {
  const float origin = sm::exp_origin(M);
  float acc = 0.0f;
  for_lane_elements<kSteps>(len, [&](int k, int j, bool inside) {
    const float e = sm::exp_from(value(k, j), origin);
    if (inside) acc = dm::add(acc, e);
    keep(k, j, e);
  });
  return dm::block_tree_sum(acc, sh);
}

// The span's sum of e^(x - M) over v. With keep_exp, v's elements are replaced by their terms
// (softmax's numerators).
template <int kSteps>
__device__ __forceinline__ float span_exp_sum(float (&v)[kSteps][kVec], int64_t len, float M, float* sh,
                                              bool keep_exp) {
  return span_exp_sum_kept<kSteps>([&](int k, int j) { return v[k][j]; },
                                   [&](int k, int j, float e) {
                                     if (keep_exp) v[k][j] = e;
                                   },
                                   len, M, sh);
}

// span_exp_sum of the elements value(k, j) (nothing kept).
template <int kSteps, typename Value>
__device__ __forceinline__ float span_exp_sum_of(Value value, int64_t len, float M, float* sh) {
  return span_exp_sum_kept<kSteps>(value, [](int, int, float) {}, len, M, sh);
}

// v's elements x -> e^(x - m) (sm::exp_term).
template <int kSteps>
__device__ __forceinline__ void to_exp(float (&v)[kSteps][kVec], float m) {
  const float origin = sm::exp_origin(m);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[k][j] = sm::exp_from(v[k][j], origin);
  }
}

// v's elements x -> p = e^(x - m) * w (sm::prob) for a segment of scale sc.
template <int kSteps>
__device__ __forceinline__ void to_prob(float (&v)[kSteps][kVec], sm::SegmentScale sc) {
  to_exp<kSteps>(v, sc.m);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) v[k][j] = dm::mul(v[k][j], sc.w);
  }
}

// The row's sum from its segments' partial sums by the canonical tree, computed by warp 0 and
// broadcast to the block through shared memory.
__device__ __forceinline__ float row_sum_from(const float* __restrict__ ws, int64_t segments, float* shared) {
  __syncthreads();
  if (threadIdx.x < 32) {
    const float r = dm::warp_tree_sum_of(segments, [&](int64_t i) { return ws[i]; });
    if (threadIdx.x == 0) *shared = r;
  }
  __syncthreads();
  return *shared;
}

// Stores this thread's elements of a span held in registers: element(k, j) is element j of its kVec
// elements of step k; a step that starts past the row's end is not stored.
template <typename S, int kSteps, typename Element>
__device__ __forceinline__ void store_held(typename S::Bits* __restrict__ dst, int64_t len, bool vec,
                                           Element element) {
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    const int64_t base = k * kStep + threadIdx.x * kVec;
    if (base >= len) continue;
    float out[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = element(k, j);
    dm::store_lane<S>(dst, base, len, vec, out);
  }
}

// Softmax or log_softmax of the span held in v. Softmax: v holds the numerators e^(x - m) (the
// terms of the segment's sum) and the outputs are e * w (sm::prob's bits); log_softmax: v holds x.
template <typename S, int kSteps>
__device__ __forceinline__ void write_outputs(const float (&v)[kSteps][kVec], typename S::Bits* __restrict__ y,
                                              int64_t len, bool vec, int32_t mode, float M, float Ssum, float w) {
  const float log_s = mode == sm::kLogSoftmax ? dm::log(Ssum) : 0.0f;
  store_held<S, kSteps>(y, len, vec, [&](int k, int j) {
    return mode == sm::kSoftmax ? dm::mul(v[k][j], w) : sm::log_prob(v[k][j], M, log_s);
  });
}

// ---- Forward, rows of one segment: stats and outputs in one kernel. ----
template <typename S, int kSteps>
__global__ void __launch_bounds__(kLanes, kMinBlocks)
    SoftmaxFusedKernel(const typename S::Bits* __restrict__ x, typename S::Bits* __restrict__ y,
                       float* __restrict__ stats, int64_t rows, int64_t n, int32_t mode) {
  __shared__ float sh[kLanes];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const typename S::Bits* xr = x + row * n;
    typename S::Bits* yr = y + row * n;
    float v[kSteps][kVec];
    load_span<S, kSteps>(xr, n, dm::vec_aligned<typename S::Bits>(xr), v);
    const float M = span_max<kSteps>(v, n, sh);
    // softmax's numerators are the sum's terms: kept.
    const float Ssum = sm::segment_term(span_exp_sum<kSteps>(v, n, M, sh, mode == sm::kSoftmax), M, M);
    if (threadIdx.x == 0) {
      stats[2 * row] = M;
      stats[2 * row + 1] = Ssum;
    }
    const float w = sm::segment_weight(M, M, sm::reciprocal(Ssum));
    write_outputs<S, kSteps>(v, yr, n, dm::vec_aligned<typename S::Bits>(yr), mode, M, Ssum, w);
  }
}

// ---- Cross-entropy's value from the row statistics. ----
template <typename S>
__device__ __forceinline__ float xent_value(const typename S::Bits* __restrict__ xr, int32_t label, int64_t n,
                                            float M, float Ssum, bool log_prob) {
  const bool valid = label >= 0 && label < n;
  const float x_label = valid ? S::load(xr[label]) : 0.0f;
  const float log_s = dm::log(Ssum);
  return log_prob ? sm::label_log_prob(x_label, M, log_s, valid) : sm::cross_entropy(x_label, M, log_s, valid);
}

template <typename S, int kSteps>
__global__ void __launch_bounds__(kLanes, kMinBlocks)
    XentFusedKernel(const typename S::Bits* __restrict__ x, const int32_t* __restrict__ labels,
                    float* __restrict__ out, float* __restrict__ stats, int64_t rows, int64_t n, bool log_prob) {
  __shared__ float sh[kLanes];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const typename S::Bits* xr = x + row * n;
    float v[kSteps][kVec];
    load_span<S, kSteps>(xr, n, dm::vec_aligned<typename S::Bits>(xr), v);
    const float M = span_max<kSteps>(v, n, sh);
    const float Ssum = sm::segment_term(span_exp_sum<kSteps>(v, n, M, sh, false), M, M);
    if (threadIdx.x == 0) {
      stats[2 * row] = M;
      stats[2 * row + 1] = Ssum;
      out[row] = xent_value<S>(xr, labels[row], n, M, Ssum, log_prob);
    }
  }
}

// ---- Staging: the next item's segment is copied into shared memory (cp.async) while this one is
// computed. ----

// Each thread stages exactly the vectors it will read itself, so it waits for its own copies only, and
// it issues the next copy into the same buffer after converting this row's values to registers.
template <typename Bits>
__device__ __forceinline__ void stage_span(typename dm::Vec<Bits>* __restrict__ stage,
                                           const Bits* __restrict__ src, int64_t len) {
  constexpr int kSteps = sm::kSegmentSteps;
  if (dm::vec_aligned<Bits>(src)) {
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      const int base = k * kStep + static_cast<int>(threadIdx.x) * kVec;
      if (base + kVec <= len) {
        const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(stage + base / kVec));
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src + base),
                     "n"(sizeof(dm::Vec<Bits>)));
      }
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// Waits for this thread's staged copies.
__device__ __forceinline__ void wait_staged() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The staged span into v (elements past len read as 0); vectors that were not staged (a short
// vector at the end, a misaligned row) come from global memory.
template <typename S>
__device__ __forceinline__ void load_staged(const typename dm::Vec<typename S::Bits>* __restrict__ stage,
                                            const typename S::Bits* __restrict__ src, int64_t len,
                                            float (&v)[sm::kSegmentSteps][kVec]) {
  using Bits = typename S::Bits;
  wait_staged();
  const bool vec = dm::vec_aligned<Bits>(src);
#pragma unroll
  for (int k = 0; k < sm::kSegmentSteps; ++k) {
    const int base = k * kStep + static_cast<int>(threadIdx.x) * kVec;
    if (vec && base + kVec <= len) {
      const dm::Vec<Bits> t = stage[base / kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[k][j] = S::load(t.e[j]);
    } else {
      dm::load_lane<S>(src, base, len, false, 0.0f, v[k]);
    }
  }
}

// The staged span's vectors in storage form (as load_span_vecs; after load_staged, whose wait
// covered these copies too).
template <typename Bits>
__device__ __forceinline__ void load_staged_vecs(const dm::Vec<Bits>* __restrict__ stage,
                                                 const Bits* __restrict__ src, int64_t len,
                                                 dm::Vec<Bits> (&b)[sm::kSegmentSteps]) {
  const bool vec = dm::vec_aligned<Bits>(src);
#pragma unroll
  for (int k = 0; k < sm::kSegmentSteps; ++k) {
    const int base = k * kStep + static_cast<int>(threadIdx.x) * kVec;
    if (vec && base + kVec <= len) {
      b[k] = stage[base / kVec];
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) b[k].e[j] = base + j < len ? src[base + j] : Bits{0};
    }
  }
}

// ---- softmax / log_softmax, rows of 2 to 16 segments, GPUs with thread block clusters: one
// cluster per row. ----
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define JAXDET_SOFTMAX_CLUSTERS 1

// One value per block of a row's cluster, exchanged without a cluster-wide barrier: every block
// writes its value into slot `rank` of every block's Slots by st.async, which counts its 4 bytes
// on the receiver's mbarrier; a block waits for its own mbarrier only. (cluster.sync() would fence
// at GPU scope, waiting for the block's outstanding memory operations, twice per row.) Two Slots
// per exchange, used by alternate rows: a block can be at most one row ahead of another, so it
// never writes a slot whose previous value its receiver has not yet read.
struct Slots {
  float value[kMaxClusterSegments];
  alignas(8) uint64_t full;  // one arrival (the receiver's own, with the expected bytes) per use
};

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The mbarriers of a block's `count` Slots, made visible to the cluster; the caller's next
// cluster.sync() orders them before any block sends.
__device__ __forceinline__ void slots_init(Slots* slots, int count) {
  if (threadIdx.x != 0) return;
  for (int i = 0; i < count; ++i) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(shared_address(&slots[i].full)));
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// This block's value v (the same in every thread) to slot `rank` of every block; `blocks` values
// will arrive here.
__device__ __forceinline__ void slots_send(Slots& slots, float v, int rank, int blocks) {
  if (threadIdx.x == 0) {  // (the bytes may land before this arrival: the phase waits for both)
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(&slots.full)),
                 "r"(static_cast<uint32_t>(blocks * sizeof(float)))
                 : "memory");
  }
  if (threadIdx.x < blocks) {
    uint32_t value, full;
    asm("mapa.shared::cluster.u32 %0, %1, %2;\n"
        : "=r"(value)
        : "r"(shared_address(&slots.value[rank])), "r"(threadIdx.x));
    asm("mapa.shared::cluster.u32 %0, %1, %2;\n"
        : "=r"(full)
        : "r"(shared_address(&slots.full)), "r"(threadIdx.x));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(value),
                 "r"(__float_as_uint(v)), "r"(full)
                 : "memory");
  }
}

// Waits for use `use` (0, 1, 2, ...) of these slots to be complete.
__device__ __forceinline__ void slots_wait(Slots& slots, uint32_t use) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(shared_address(&slots.full)), "r"(use & 1u)
        : "memory");
  } while (!done);
}

// The maximum (order-free) of the blocks' values; every warp computes it, every thread gets it.
__device__ __forceinline__ float slots_max(const Slots& slots, int blocks) {
  const int lane = threadIdx.x & 31;
  float m = lane < blocks ? slots.value[lane] : dm::neg_inf();
#pragma unroll
  for (int s = 16; s >= 1; s >>= 1) m = dm::max(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
  return m;
}

// S from the blocks' maxima and sums: the canonical tree (warp_tree_sum) over the segments' terms
// s_k * e^(m_k - M) in rank (= segment) order; every warp computes it, every thread gets it.
__device__ __forceinline__ float slots_row_sum(const Slots& sums, const Slots& maxima, float M, int blocks) {
  const int lane = threadIdx.x & 31;
  const int k = lane < blocks ? lane : 0;
  const float v = dm::warp_tree_sum(sm::segment_term(sums.value[k], maxima.value[k], M), blocks);
  return __shfl_sync(0xFFFFFFFFu, v, 0);
}

// The canonical tree sum (warp_tree_sum) of the blocks' values in rank (= segment) order; every
// warp computes it, every thread gets it.
__device__ __forceinline__ float slots_tree_sum(const Slots& slots, int blocks) {
  const int lane = threadIdx.x & 31;
  const float v = dm::warp_tree_sum(slots.value[lane < blocks ? lane : 0], blocks);
  return __shfl_sync(0xFFFFFFFFu, v, 0);
}
#endif

// Block r of a row's cluster holds segment r: its max m_r and its sum of e^(x - m_r) reach every
// block of the cluster together (Slots), which all combine them into the row's M and S. Softmax /
// log_softmax outputs, or (kXent) the cross-entropy (mode: 1 for the label's log-prob).
template <typename S, bool kXent>
__global__ void __launch_bounds__(kLanes, kMinBlocks)
    ClusterFwdKernel(const typename S::Bits* __restrict__ x, typename S::Bits* __restrict__ y,
                     const int32_t* __restrict__ labels, float* __restrict__ out, float* __restrict__ stats,
                     int64_t rows, int64_t n, int32_t mode) {
#ifdef JAXDET_SOFTMAX_CLUSTERS
  using Bits = typename S::Bits;
  constexpr int kSteps = sm::kSegmentSteps;
  __shared__ float sh[kLanes];
  __shared__ Slots exchange[2][2];  // [the maxima, the sums][row parity]
  __shared__ dm::Vec<Bits> stage[sm::kSegment / kVec];
  const cg::cluster_group cluster = cg::this_cluster();
  const int segments = static_cast<int>(cluster.num_blocks());
  const int seg = static_cast<int>(cluster.block_rank());
  const int64_t len = sm::segment_length(n, seg);
  const int64_t width = sm::stat_width(n);
  slots_init(&exchange[0][0], 4);
  cluster.sync();  // every block's mbarriers exist before any value is sent
  if (blockIdx.y < rows) stage_span<Bits>(stage, x + int64_t{blockIdx.y} * n + seg * sm::kSegment, len);
  uint32_t it = 0;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y, ++it) {
    const int64_t offset = row * n + seg * sm::kSegment;
    Slots& row_maxima = exchange[0][it & 1];
    Slots& row_sums = exchange[1][it & 1];
    float v[kSteps][kVec];
    load_staged<S>(stage, x + offset, len, v);
    if (row + gridDim.y < rows) stage_span<Bits>(stage, x + offset + int64_t{gridDim.y} * n, len);
    const float m = span_max<kSteps>(v, len, sh);
    // softmax's numerators are the sum's terms: kept.
    const float s = span_exp_sum<kSteps>(v, len, m, sh, !kXent && mode == sm::kSoftmax);
    slots_send(row_maxima, m, seg, segments);
    slots_send(row_sums, s, seg, segments);
    slots_wait(row_maxima, it >> 1);
    slots_wait(row_sums, it >> 1);
    const float M = slots_max(row_maxima, segments);
    const float Ssum = slots_row_sum(row_sums, row_maxima, M, segments);
    if (threadIdx.x == 0) {
      float* st = stats + row * width;
      st[2 + seg] = m;
      if (seg == 0) {
        st[0] = M;
        st[1] = Ssum;
        if (kXent) out[row] = xent_value<S>(x + row * n, labels[row], n, M, Ssum, mode != 0);
      }
    }
    if (!kXent) {
      write_outputs<S, kSteps>(v, y + offset, len, dm::vec_aligned<Bits>(y + offset), mode, M, Ssum,
                               sm::segment_weight(m, M, sm::reciprocal(Ssum)));
    }
  }
  cluster.sync();  // no block leaves while a value may still be on its way to it
#endif
}

// ---- Other rows of several segments: each (row, segment) reduced into the workspace [R,
// segments] of float2 (m_k, s_k), then one warp per row; softmax / log_softmax then write the
// outputs. ----

// Item q = row * segments + seg of a grid-stride loop: its row, the segment's offset in the
// [rows, n] arrays and its length, and the segment's index in its row.
struct SegmentItem {
  int64_t row, offset, len, seg;
};

__device__ __forceinline__ SegmentItem segment_item(int64_t q, int64_t segments, int64_t n) {
  const int64_t row = q / segments, seg = q % segments;
  return SegmentItem{row, row * n + seg * sm::kSegment, sm::segment_length(n, seg), seg};
}

// Each (row, segment)'s max m_k and sum s_k of e^(x - m_k); the next item's segment is staged
// while this one is reduced. No block waits for another.
template <typename S>
__global__ void __launch_bounds__(kLanes, sizeof(typename S::Bits) == 2 ? kMinBlocks + 1 : kMinBlocks)
    SegmentStatsKernel(const typename S::Bits* __restrict__ x, float2* __restrict__ ws, int64_t rows, int64_t n) {
  using Bits = typename S::Bits;
  constexpr int kSteps = sm::kSegmentSteps;
  __shared__ float sh[kLanes];
  __shared__ dm::Vec<Bits> stage[sm::kSegment / kVec];
  const int64_t segments = sm::segment_count(n), items = rows * segments;
  if (blockIdx.x < items) {
    const SegmentItem first = segment_item(blockIdx.x, segments, n);
    stage_span<Bits>(stage, x + first.offset, first.len);
  }
  for (int64_t q = blockIdx.x; q < items; q += gridDim.x) {
    const auto [row, offset, len, seg] = segment_item(q, segments, n);
    // Held in storage form (a bfloat16/float16 segment in half the registers: more resident
    // blocks), widened at each of the two uses.
    dm::Vec<Bits> raw[kSteps];
    wait_staged();
    load_staged_vecs<Bits>(stage, x + offset, len, raw);
    const auto value = [&](int k, int j) { return S::load(raw[k].e[j]); };
    const float m = span_max_of<kSteps>(value, len, sh);
    // (after the max has used every value read from the stage, so no copy overtakes a read)
    if (q + gridDim.x < items) {
      const SegmentItem next = segment_item(q + gridDim.x, segments, n);
      stage_span<Bits>(stage, x + next.offset, next.len);
    }
    const float s = span_exp_sum_of<kSteps>(value, len, m, sh);
    if (threadIdx.x == 0) ws[q] = make_float2(m, s);
  }
}

// The row's max from its segments' maxima (order-free), by one warp; every lane gets it.
__device__ __forceinline__ float warp_row_max(const float2* __restrict__ pairs, int64_t segments) {
  float m = dm::neg_inf();
  for (int64_t i = threadIdx.x & 31; i < segments; i += 32) m = dm::max(m, pairs[i].x);
#pragma unroll
  for (int s = 16; s >= 1; s >>= 1) m = dm::max(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
  return m;
}

// Warps of a grid-stride loop over rows: one warp per row.
__device__ __forceinline__ int64_t first_warp() { return (int64_t{blockIdx.x} * kLanes + threadIdx.x) / 32; }
__device__ __forceinline__ int64_t warp_stride() { return int64_t{gridDim.x} * (kLanes / 32); }

// Each row's statistics (M, S, the m_k) from its segments' (m_k, s_k), and (kXent) the
// cross-entropy.
template <typename S, bool kXent>
__global__ void __launch_bounds__(kLanes)
    RowStatsKernel(const typename S::Bits* __restrict__ x, const int32_t* __restrict__ labels,
                   const float2* __restrict__ ws, float* __restrict__ out, float* __restrict__ stats, int64_t rows,
                   int64_t n, bool log_prob) {
  const int64_t segments = sm::segment_count(n), width = sm::stat_width(n);
  const int lane = threadIdx.x & 31;
  for (int64_t row = first_warp(); row < rows; row += warp_stride()) {
    const float2* pairs = ws + row * segments;
    float* st = stats + row * width;
    const float M = warp_row_max(pairs, segments);
    const float Ssum =
        dm::warp_tree_sum_of(segments, [&](int64_t i) { return sm::segment_term(pairs[i].y, pairs[i].x, M); });
    for (int64_t i = lane; i < segments; i += 32) st[2 + i] = pairs[i].x;
    if (lane == 0) {
      st[0] = M;
      st[1] = Ssum;
      if (kXent) out[row] = xent_value<S>(x + row * n, labels[row], n, M, Ssum, log_prob);
    }
  }
}

// softmax / log_softmax outputs of each (row, segment) from the row's statistics.
template <typename S>
__global__ void __launch_bounds__(kLanes, kMinBlocks)
    SoftmaxOutKernel(const typename S::Bits* __restrict__ x, const float* __restrict__ stats,
                     typename S::Bits* __restrict__ y, int64_t rows, int64_t n, int32_t mode) {
  constexpr int kSteps = sm::kSegmentSteps;
  const int64_t segments = sm::segment_count(n), width = sm::stat_width(n);
  for (int64_t q = blockIdx.x; q < rows * segments; q += gridDim.x) {
    const auto [row, offset, len, seg] = segment_item(q, segments, n);
    const float* st = stats + row * width;
    float v[kSteps][kVec];
    load_span<S, kSteps>(x + offset, len, dm::vec_aligned<typename S::Bits>(x + offset), v);
    const sm::SegmentScale sc = sm::segment_scale(st, seg, segments);
    if (mode == sm::kSoftmax) to_exp<kSteps>(v, sc.m);
    write_outputs<S, kSteps>(v, y + offset, len, dm::vec_aligned<typename S::Bits>(y + offset), mode, st[0], st[1],
                             sc.w);
  }
}

// ---- Backward of softmax / log_softmax. ----

template <typename S, int kSteps>
__device__ __forceinline__ float span_bwd_sum(const float (&p)[kSteps][kVec],
                                              const dm::Vec<typename S::Bits> (&gv)[kSteps], int64_t len,
                                              int32_t mode, float* sh) {
  float acc = 0.0f;
  for_lane_elements<kSteps>(len, [&](int k, int j, bool inside) {
    if (inside) acc = dm::add(acc, sm::bwd_term(S::load(gv[k].e[j]), p[k][j], mode));
  });
  return dm::block_tree_sum(acc, sh);
}

template <typename S, int kSteps>
__device__ __forceinline__ void write_bwd(const float (&p)[kSteps][kVec],
                                          const dm::Vec<typename S::Bits> (&gv)[kSteps],
                                          typename S::Bits* __restrict__ dx, int64_t len, bool vec, float total,
                                          int32_t mode) {
  store_held<S, kSteps>(dx, len, vec,
                        [&](int k, int j) { return sm::bwd(S::load(gv[k].e[j]), p[k][j], total, mode); });
}

template <typename S, int kSteps>
__global__ void __launch_bounds__(kLanes, kMinBlocks)
    SoftmaxBwdFusedKernel(const typename S::Bits* __restrict__ x, const float* __restrict__ stats,
                          const typename S::Bits* __restrict__ g, typename S::Bits* __restrict__ dx, int64_t rows,
                          int64_t n, int32_t mode) {
  using Bits = typename S::Bits;
  __shared__ float sh[kLanes];
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t offset = row * n;
    const bool vec = dm::vec_aligned<Bits>(x + offset) && dm::vec_aligned<Bits>(g + offset);
    float v[kSteps][kVec];
    dm::Vec<Bits> gv[kSteps];
    load_span<S, kSteps>(x + offset, n, vec, v);
    load_span_vecs<Bits, kSteps>(g + offset, n, vec, gv);
    to_prob<kSteps>(v, sm::segment_scale(stats + 2 * row, 0, 1));
    const float total = span_bwd_sum<S, kSteps>(v, gv, n, mode, sh);
    write_bwd<S, kSteps>(v, gv, dx + offset, n, dm::vec_aligned<Bits>(dx + offset), total, mode);
  }
}

// Rows of several segments, pass 1: each (row, segment)'s partial sum.
template <typename S>
__global__ void __launch_bounds__(kLanes, kMinBlocks)
    SegmentBwdSumKernel(const typename S::Bits* __restrict__ x, const float* __restrict__ stats,
                        const typename S::Bits* __restrict__ g, float* __restrict__ ws, int64_t rows, int64_t n,
                        int32_t mode) {
  using Bits = typename S::Bits;
  constexpr int kSteps = sm::kSegmentSteps;
  __shared__ float sh[kLanes];
  const int64_t segments = sm::segment_count(n), width = sm::stat_width(n);
  for (int64_t q = blockIdx.x; q < rows * segments; q += gridDim.x) {
    const auto [row, offset, len, seg] = segment_item(q, segments, n);
    const bool vec = dm::vec_aligned<Bits>(x + offset) && dm::vec_aligned<Bits>(g + offset);
    float v[kSteps][kVec];
    dm::Vec<Bits> gv[kSteps];
    load_span<S, kSteps>(x + offset, len, vec, v);
    load_span_vecs<Bits, kSteps>(g + offset, len, vec, gv);
    to_prob<kSteps>(v, sm::segment_scale(stats + row * width, seg, segments));
    const float total = span_bwd_sum<S, kSteps>(v, gv, len, mode, sh);
    if (threadIdx.x == 0) ws[q] = total;
  }
}

// Rows of several segments, pass 2: dx of each (row, segment).
template <typename S>
__global__ void __launch_bounds__(kLanes, kMinBlocks)
    SegmentBwdOutKernel(const typename S::Bits* __restrict__ x, const float* __restrict__ stats,
                        const typename S::Bits* __restrict__ g, const float* __restrict__ ws,
                        typename S::Bits* __restrict__ dx, int64_t rows, int64_t n, int32_t mode) {
  using Bits = typename S::Bits;
  constexpr int kSteps = sm::kSegmentSteps;
  __shared__ float shared;
  const int64_t segments = sm::segment_count(n), width = sm::stat_width(n);
  for (int64_t q = blockIdx.x; q < rows * segments; q += gridDim.x) {
    const auto [row, offset, len, seg] = segment_item(q, segments, n);
    const bool vec = dm::vec_aligned<Bits>(x + offset) && dm::vec_aligned<Bits>(g + offset);
    const float total = row_sum_from(ws + row * segments, segments, &shared);
    float v[kSteps][kVec];
    dm::Vec<Bits> gv[kSteps];
    load_span<S, kSteps>(x + offset, len, vec, v);
    load_span_vecs<Bits, kSteps>(g + offset, len, vec, gv);
    to_prob<kSteps>(v, sm::segment_scale(stats + row * width, seg, segments));
    write_bwd<S, kSteps>(v, gv, dx + offset, len, dm::vec_aligned<Bits>(dx + offset), total, mode);
  }
}

// Rows of 2 to 16 segments, GPUs with clusters: block r of a row's cluster holds segment r of x
// and g; the segments' partial sums reach every block (Slots, alternating between rows).
template <typename S>
__global__ void __launch_bounds__(kLanes, kMinBlocks)
    ClusterBwdKernel(const typename S::Bits* __restrict__ x, const float* __restrict__ stats,
                     const typename S::Bits* __restrict__ g, typename S::Bits* __restrict__ dx, int64_t rows,
                     int64_t n, int32_t mode) {
#ifdef JAXDET_SOFTMAX_CLUSTERS
  using Bits = typename S::Bits;
  constexpr int kSteps = sm::kSegmentSteps;
  __shared__ float sh[kLanes];
  __shared__ Slots sums[2];
  extern __shared__ __align__(16) unsigned char stage_bytes[];  // x's segment, then g's
  auto* stage_x = reinterpret_cast<dm::Vec<Bits>*>(stage_bytes);
  dm::Vec<Bits>* stage_g = stage_x + sm::kSegment / kVec;
  const cg::cluster_group cluster = cg::this_cluster();
  const int segments = static_cast<int>(cluster.num_blocks());
  const int seg = static_cast<int>(cluster.block_rank());
  const int64_t len = sm::segment_length(n, seg);
  const int64_t width = sm::stat_width(n);
  slots_init(sums, 2);
  cluster.sync();  // every block's mbarriers exist before any value is sent
  if (blockIdx.y < rows) {
    const int64_t first = int64_t{blockIdx.y} * n + seg * sm::kSegment;
    stage_span<Bits>(stage_x, x + first, len);
    stage_span<Bits>(stage_g, g + first, len);
  }
  uint32_t it = 0;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y, ++it) {
    const int64_t offset = row * n + seg * sm::kSegment;
    // (before the segment is live in registers: the division's slow path is a call)
    const sm::SegmentScale sc = sm::segment_scale(stats + row * width, seg, segments);
    float v[kSteps][kVec];
    dm::Vec<Bits> gv[kSteps];
    load_staged<S>(stage_x, x + offset, len, v);
    load_staged_vecs<Bits>(stage_g, g + offset, len, gv);
    if (row + gridDim.y < rows) {
      stage_span<Bits>(stage_x, x + offset + int64_t{gridDim.y} * n, len);
      stage_span<Bits>(stage_g, g + offset + int64_t{gridDim.y} * n, len);
    }
    Slots& row_sums = sums[it & 1];
    to_prob<kSteps>(v, sc);
    slots_send(row_sums, span_bwd_sum<S, kSteps>(v, gv, len, mode, sh), seg, segments);
    slots_wait(row_sums, it >> 1);
    const float total = slots_tree_sum(row_sums, segments);
    write_bwd<S, kSteps>(v, gv, dx + offset, len, dm::vec_aligned<Bits>(dx + offset), total, mode);
  }
  cluster.sync();  // no block leaves while a value may still be on its way to it
#endif
}

// ---- Cross-entropy backward: elementwise, one block per (row, segment) at a time. A thread
// streams its vectors (a few in flight) rather than holding the segment: few registers, many
// resident warps. ----
template <typename S>
__global__ void __launch_bounds__(kLanes)
    XentBwdKernel(const typename S::Bits* __restrict__ x, const int32_t* __restrict__ labels,
                  const float* __restrict__ stats, const float* __restrict__ g, typename S::Bits* __restrict__ dx,
                  int64_t rows, int64_t n) {
  using Bits = typename S::Bits;
  const int64_t segments = sm::segment_count(n), width = sm::stat_width(n);
  for (int64_t q = blockIdx.x; q < rows * segments; q += gridDim.x) {
    const auto [row, offset, len, seg] = segment_item(q, segments, n);
    const int32_t label = labels[row];
    const bool valid = label >= 0 && label < n;
    const float gr = g[row];
    const sm::SegmentScale sc = sm::segment_scale(stats + row * width, seg, segments);
    const float origin = sm::exp_origin(sc.m);
    const bool vec_in = dm::vec_aligned<Bits>(x + offset), vec_out = dm::vec_aligned<Bits>(dx + offset);
    // The label's place in this segment (int: a segment has kSegment elements), -1 if elsewhere.
    const int64_t at = label - (offset - row * n);
    const int label_here = valid && at >= 0 && at < len ? static_cast<int>(at) : -1;
    const auto grad = [&](int base, const float (&v)[kVec], float (&out)[kVec]) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float p = dm::mul(sm::exp_from(v[j], origin), sc.w);  // sm::prob
        out[j] = sm::xent_bwd_valid(gr, p, base + j == label_here);
      }
    };
    if (!valid) {  // (sm::xent_bwd: x is not read)
      const float d = sm::xent_bwd_invalid(gr);
      const float out[kVec] = {d, d, d, d};
      for (int base = static_cast<int>(threadIdx.x) * kVec; base < len; base += kStep) {
        dm::store_lane<S>(dx + offset, base, len, vec_out, out);
      }
    } else if (len == sm::kSegment && vec_in && vec_out) {  // whole vectors, kBatch loads in flight
      constexpr int kBatch = 4;
      const auto* src = reinterpret_cast<const dm::Vec<Bits>*>(x + offset);
      auto* dst = reinterpret_cast<dm::Vec<Bits>*>(dx + offset);
#pragma unroll
      for (int k0 = 0; k0 < sm::kSegmentSteps; k0 += kBatch) {
        dm::Vec<Bits> t[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) t[b] = src[((k0 + b) * kStep) / kVec + threadIdx.x];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int base = (k0 + b) * kStep + static_cast<int>(threadIdx.x) * kVec;
          float v[kVec], out[kVec];
#pragma unroll
          for (int j = 0; j < kVec; ++j) v[j] = S::load(t[b].e[j]);
          grad(base, v, out);
          dm::Vec<Bits> o;
#pragma unroll
          for (int j = 0; j < kVec; ++j) o.e[j] = S::store(out[j]);
          dst[base / kVec] = o;
        }
      }
    } else {
      for (int base = static_cast<int>(threadIdx.x) * kVec; base < len; base += kStep) {
        float v[kVec], out[kVec];
        dm::load_lane<S>(x + offset, base, len, vec_in, 0.0f, v);
        grad(base, v, out);
        dm::store_lane<S>(dx + offset, base, len, vec_out, out);
      }
    }
  }
}

// The deterministic math functions elementwise (a test target).
__global__ void DetMathKernel(const float* __restrict__ x, float* __restrict__ y, int64_t count, int32_t op) {
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float v = x[i];
    y[i] = dm::canonical(op == 0   ? dm::exp(v)
                         : op == 1 ? dm::log(v)
                         : op == 2 ? dm::rsqrt(v)
                                   : dm::exp_nonpositive(v));
  }
}

unsigned GridFor(int64_t items) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(items, int64_t{current_sm_count()} * 32)));
}

// Runs CALL with kSteps (the register-held steps of a one-segment span of n elements) a constant.
#define JAXDET_WITH_STEPS(n, CALL) \
  if ((n) <= 1 * kStep) {          \
    constexpr int kSteps = 1;      \
    CALL;                          \
  } else if ((n) <= 2 * kStep) {   \
    constexpr int kSteps = 2;      \
    CALL;                          \
  } else if ((n) <= 4 * kStep) {   \
    constexpr int kSteps = 4;      \
    CALL;                          \
  } else {                         \
    constexpr int kSteps = 8;      \
    CALL;                          \
  }

// Dynamic shared memory of ClusterBwdKernel: the staged segments of x and g.
template <typename S>
constexpr size_t kBwdStageBytes = 2 * sm::kSegment * sizeof(typename S::Bits);

// A launch of `clusters` clusters of `segments` blocks of kLanes threads (cluster c in grid row
// c); the config points at `attr`, which must outlive it.
cudaLaunchConfig_t ClusterLaunch(cudaLaunchAttribute& attr, int64_t segments, int64_t clusters, size_t smem,
                                 cudaStream_t stream) {
  return cluster_launch_config(attr, static_cast<unsigned>(segments),
                               dim3(static_cast<unsigned>(segments), static_cast<unsigned>(clusters), 1), kLanes,
                               smem, stream);
}

// How many clusters of `segments` blocks of `kernel` (with `smem` bytes of dynamic shared memory)
// the current device runs at once; 0 if it cannot run them (max_active_clusters).
template <typename Kernel>
int ActiveClusters(Kernel kernel, int segments, size_t smem, int device) {
  if ((segments > 8 &&
       cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) ||
      (smem > 0 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)) != cudaSuccess)) {
    cudaGetLastError();
    return 0;
  }
  return max_active_clusters(kernel, device, static_cast<unsigned>(segments), kLanes, smem);
}

// How many clusters of kKernel's blocks to launch for rows of `segments` segments on the current
// device (as many as run at once: each walks its rows, staging the next while computing this one),
// or 0 for the pass kernels: clusters not supported or not schedulable, or turned off by
// JAXDET_TESTING=softmax=passes (which makes a Hopper GPU run the pass kernels, as an Ampere GPU
// does). Asked once per (device, segment count). Either path computes the same bits.
template <auto kKernel>
int ClusterGrid(int64_t segments, size_t smem) {
  constexpr int kDevices = 64;
  static std::atomic<int> known[kDevices][kMaxClusterSegments + 1];  // 0 unknown, else 1 + clusters
  static const bool passes_forced = [] {
    const std::string* v = testing_override("softmax");
    return v != nullptr && *v == "passes";
  }();
  if (passes_forced || segments < 2 || segments > kMaxClusterSegments) return 0;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) {
    cudaGetLastError();
    return 0;
  }
  std::atomic<int>& state = known[device][segments];
  if (state.load(std::memory_order_relaxed) == 0) {
    state.store(1 + ActiveClusters(kKernel, static_cast<int>(segments), smem, device), std::memory_order_relaxed);
  }
  return state.load(std::memory_order_relaxed) - 1;
}

// `clusters` clusters of `segments` blocks (at most one per row), grid-stride over rows in y.
template <typename... Params, typename... Args>
void LaunchClusters(void (*kernel)(Params...), int64_t segments, int64_t rows, int clusters, size_t smem,
                    cudaStream_t stream, Args... args) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = ClusterLaunch(attr, segments, std::min<int64_t>(rows, clusters), smem, stream);
  cudaLaunchKernelEx(&cfg, kernel, args...);  // an error is left for last_launch_error
}

template <typename S>
void LaunchSoftmaxFwd(cudaStream_t stream, const void* x, void* y, float* stats, float* ws, int64_t rows,
                      int64_t n, int32_t mode) {
  using Bits = typename S::Bits;
  const auto* xp = static_cast<const Bits*>(x);
  auto* yp = static_cast<Bits*>(y);
  const int64_t segments = sm::segment_count(n);
  if (segments == 1) {
    JAXDET_WITH_STEPS(
        n, (SoftmaxFusedKernel<S, kSteps><<<GridFor(rows), kLanes, 0, stream>>>(xp, yp, stats, rows, n, mode)));
    return;
  }
  if (const int clusters = ClusterGrid<ClusterFwdKernel<S, false>>(segments, 0); clusters > 0) {
    LaunchClusters(ClusterFwdKernel<S, false>, segments, rows, clusters, 0, stream, xp, yp,
                   static_cast<const int32_t*>(nullptr), static_cast<float*>(nullptr), stats, rows, n, mode);
    return;
  }
  auto* pairs = reinterpret_cast<float2*>(ws);
  SegmentStatsKernel<S><<<GridFor(rows * segments), kLanes, 0, stream>>>(xp, pairs, rows, n);
  RowStatsKernel<S, false>
      <<<GridFor((rows + 7) / 8), kLanes, 0, stream>>>(xp, nullptr, pairs, nullptr, stats, rows, n, false);
  SoftmaxOutKernel<S><<<GridFor(rows * segments), kLanes, 0, stream>>>(xp, stats, yp, rows, n, mode);
}

template <typename S>
void LaunchSoftmaxBwd(cudaStream_t stream, const void* x, const float* stats, const void* g, void* dx, float* ws,
                      int64_t rows, int64_t n, int32_t mode) {
  using Bits = typename S::Bits;
  const auto* xp = static_cast<const Bits*>(x);
  const auto* gp = static_cast<const Bits*>(g);
  auto* dp = static_cast<Bits*>(dx);
  const int64_t segments = sm::segment_count(n);
  if (segments == 1) {
    JAXDET_WITH_STEPS(n, (SoftmaxBwdFusedKernel<S, kSteps>
                          <<<GridFor(rows), kLanes, 0, stream>>>(xp, stats, gp, dp, rows, n, mode)));
    return;
  }
  if (const int clusters = ClusterGrid<ClusterBwdKernel<S>>(segments, kBwdStageBytes<S>); clusters > 0) {
    LaunchClusters(ClusterBwdKernel<S>, segments, rows, clusters, kBwdStageBytes<S>, stream, xp, stats, gp, dp,
                   rows, n, mode);
    return;
  }
  SegmentBwdSumKernel<S><<<GridFor(rows * segments), kLanes, 0, stream>>>(xp, stats, gp, ws, rows, n, mode);
  SegmentBwdOutKernel<S><<<GridFor(rows * segments), kLanes, 0, stream>>>(xp, stats, gp, ws, dp, rows, n, mode);
}

template <typename S>
void LaunchXentFwd(cudaStream_t stream, const void* x, const int32_t* labels, float* out, float* stats, float* ws,
                   int64_t rows, int64_t n, bool log_prob) {
  using Bits = typename S::Bits;
  const auto* xp = static_cast<const Bits*>(x);
  const int64_t segments = sm::segment_count(n);
  if (segments == 1) {
    JAXDET_WITH_STEPS(n, (XentFusedKernel<S, kSteps>
                          <<<GridFor(rows), kLanes, 0, stream>>>(xp, labels, out, stats, rows, n, log_prob)));
    return;
  }
  // Rows that fit in one wave of clusters: one launch. More rows: every segment on its own (no
  // block waits for the row's other segments), then one warp per row.
  if (const int clusters = ClusterGrid<ClusterFwdKernel<S, true>>(segments, 0); clusters > 0 && rows <= clusters) {
    LaunchClusters(ClusterFwdKernel<S, true>, segments, rows, clusters, 0, stream, xp, static_cast<Bits*>(nullptr),
                   labels, out, stats, rows, n, static_cast<int32_t>(log_prob));
    return;
  }
  auto* pairs = reinterpret_cast<float2*>(ws);
  SegmentStatsKernel<S><<<GridFor(rows * segments), kLanes, 0, stream>>>(xp, pairs, rows, n);
  RowStatsKernel<S, true>
      <<<GridFor((rows + 7) / 8), kLanes, 0, stream>>>(xp, labels, pairs, out, stats, rows, n, log_prob);
}

template <typename S>
void LaunchXentBwd(cudaStream_t stream, const void* x, const int32_t* labels, const float* stats, const float* g,
                   void* dx, int64_t rows, int64_t n) {
  using Bits = typename S::Bits;
  const auto* xp = static_cast<const Bits*>(x);
  auto* dp = static_cast<Bits*>(dx);
  const int64_t items = rows * sm::segment_count(n);
  XentBwdKernel<S><<<GridFor(items), kLanes, 0, stream>>>(xp, labels, stats, g, dp, rows, n);
}

// The workspace must hold `per_segment` floats for every (row, segment) when rows have several.
ffi::Error CheckWorkspace(const ffi::Buffer<ffi::F32>& ws, int64_t rows, int64_t n, int64_t per_segment,
                          const char* op) {
  const int64_t segments = sm::segment_count(n);
  if (segments > 1 && static_cast<int64_t>(ws.element_count()) < rows * segments * per_segment) {
    return ffi::Error::InvalidArgument(std::string(op) + ": workspace too small");
  }
  return ffi::Error::Success();
}

ffi::Error SoftmaxFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::Buffer<ffi::F32>> stats, ffi::Result<ffi::Buffer<ffi::F32>> ws,
                          int32_t mode) {
  constexpr const char* kOp = "jaxdet_softmax_fwd";
  int64_t rows, n;
  if (auto err = sm::rows_of(x, rows, n, kOp); !err.success()) return err;
  if (rows == 0 || n == 0) return ffi::Error::Success();
  if (auto err = CheckWorkspace(*ws, rows, n, 2, kOp); !err.success()) return err;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        LaunchSoftmaxFwd<S>(stream, x.untyped_data(), y->untyped_data(), stats->typed_data(),
                                            ws->typed_data(), rows, n, mode));
  return last_launch_error(kOp);
}

ffi::Error SoftmaxBwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> stats, ffi::AnyBuffer g,
                          ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> ws, int32_t mode) {
  constexpr const char* kOp = "jaxdet_softmax_bwd";
  int64_t rows, n;
  if (auto err = sm::check_bwd_call(x, stats, g, rows, n, kOp); !err.success()) return err;
  if (rows == 0 || n == 0) return ffi::Error::Success();
  if (auto err = CheckWorkspace(*ws, rows, n, 1, kOp); !err.success()) return err;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        LaunchSoftmaxBwd<S>(stream, x.untyped_data(), stats.typed_data(), g.untyped_data(),
                                            dx->untyped_data(), ws->typed_data(), rows, n, mode));
  return last_launch_error(kOp);
}

ffi::Error XentFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> labels,
                       ffi::Result<ffi::Buffer<ffi::F32>> out, ffi::Result<ffi::Buffer<ffi::F32>> stats,
                       ffi::Result<ffi::Buffer<ffi::F32>> ws, bool log_prob) {
  constexpr const char* kOp = "jaxdet_xent_fwd";
  int64_t rows, n;
  if (auto err = sm::check_xent_fwd_call(x, labels, rows, n, kOp); !err.success()) return err;
  if (rows == 0) return ffi::Error::Success();
  if (auto err = CheckWorkspace(*ws, rows, n, 2, kOp); !err.success()) return err;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        LaunchXentFwd<S>(stream, x.untyped_data(), labels.typed_data(), out->typed_data(),
                                         stats->typed_data(), ws->typed_data(), rows, n, log_prob));
  return last_launch_error(kOp);
}

ffi::Error XentBwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> labels,
                       ffi::Buffer<ffi::F32> stats, ffi::Buffer<ffi::F32> g, ffi::Result<ffi::AnyBuffer> dx) {
  constexpr const char* kOp = "jaxdet_xent_bwd";
  int64_t rows, n;
  if (auto err = sm::rows_of(x, rows, n, kOp); !err.success()) return err;
  if (rows == 0 || n == 0) return ffi::Error::Success();
  if (auto err = sm::stats_fit(stats, rows, sm::stat_width(n), kOp); !err.success()) return err;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        LaunchXentBwd<S>(stream, x.untyped_data(), labels.typed_data(), stats.typed_data(),
                                         g.typed_data(), dx->untyped_data(), rows, n));
  return last_launch_error(kOp);
}

ffi::Error DetMathCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> y,
                       int32_t op) {
  const int64_t count = static_cast<int64_t>(x.element_count());
  if (count == 0) return ffi::Error::Success();
  DetMathKernel<<<GridFor((count + kLanes - 1) / kLanes), kLanes, 0, stream>>>(x.typed_data(), y->typed_data(),
                                                                               count, op);
  return last_launch_error("jaxdet_det_math");
}

}  // namespace

// Kernels on XLA's stream only (the workspaces are results; the cluster attributes and occupancy
// are host-only queries, once per device), so XLA may record every handler into its command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_softmax_fwd_cuda, SoftmaxFwdCuda,
                              sm::bind_softmax_fwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_softmax_bwd_cuda, SoftmaxBwdCuda,
                              sm::bind_softmax_bwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_xent_fwd_cuda, XentFwdCuda,
                              sm::bind_xent_fwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_xent_bwd_cuda, XentBwdCuda,
                              sm::bind_xent_bwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_det_math_cuda, DetMathCuda,
                              sm::bind_det_math(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxdet
