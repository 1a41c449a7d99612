// CUDA target of the segment sum (jaxdet_segment_sum). A first kernel finds where each segment
// starts in the sorted order (a binary search per segment, into the workspace); then one warp per
// (segment, column tile): each lane owns kVec consecutive columns (16 bytes of data) and folds the
// segment's tokens in ascending token order, keeping the chunk partials on the canonical tree of
// embed_math.h. The warp reads 32 token indices at a time (one per lane, then shuffled) and has
// kPrefetch rows in flight before adding them in order. Every element's bits depend on its
// segment's tokens and their values only: not on the launch grid, the other segments, T, V or D.
// No atomics; empty segments write +0.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_common.h"
#include "common/det_math.h"
#include "embed/embed_ffi.h"
#include "embed/embed_math.h"

namespace jaxdet {
namespace embed {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPrefetch = 8;  // rows loaded before they are added (divides 32)
constexpr unsigned kFullMask = 0xFFFFFFFFu;

template <typename Storage, int kVec>
union Row {
  static constexpr int kWords = static_cast<int>(kVec * sizeof(typename Storage::Bits) / 16);
  uint4 v[kWords];
  typename Storage::Bits e[kVec];
};

// offsets[l * (V + 1) + v] = the number of ids of batch element l below v, for v in [0, V].
__global__ void __launch_bounds__(kThreads)
    SegmentOffsetsKernel(const int32_t* __restrict__ sorted_ids, int32_t* __restrict__ offsets, int64_t T,
                         int64_t V, int64_t count) {
  for (int64_t i = int64_t{blockIdx.x} * kThreads + threadIdx.x; i < count; i += int64_t{gridDim.x} * kThreads) {
    const int64_t l = i / (V + 1);
    offsets[i] = static_cast<int32_t>(count_below(sorted_ids + l * T, T, i - l * (V + 1)));
  }
}

template <typename In, typename Out>
__global__ void __launch_bounds__(kThreads)
    SegmentSumKernel(const typename In::Bits* __restrict__ data, const int32_t* __restrict__ order,
                     const int32_t* __restrict__ offsets, typename Out::Bits* __restrict__ out, int64_t T,
                     int64_t D, int64_t V, int32_t chunk_tokens, int64_t tiles, int64_t tasks, bool vectors) {
  constexpr int kVec = static_cast<int>(16 / sizeof(typename In::Bits));
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t task = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; task < tasks;
       task += int64_t{gridDim.x} * kWarps) {
    const int64_t seg = task / tiles;  // l * V + v
    const int64_t l = seg / V, v = seg - l * V;
    const int64_t col0 = (task - seg * tiles) * (32 * kVec) + lane * kVec;
    const int64_t left = D - col0;
    const int cols = left <= 0 ? 0 : left < kVec ? static_cast<int>(left) : kVec;
    const bool whole = vectors && cols == kVec;
    const int32_t begin = offsets[l * (V + 1) + v], end = offsets[l * (V + 1) + v + 1];
    float result[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) result[j] = 0.0f;
    if (begin < end) {  // uniform over the warp
      const typename In::Bits* src = data + l * T * D + col0;
      const int32_t* tokens = order + l * T;
      ChunkTree<kVec> tree;
      float acc[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = 0.0f;
      int32_t chunk = tokens[begin] / chunk_tokens;
      for (int32_t i0 = begin; i0 < end; i0 += 32) {
        const int n = min(32, end - i0);
        const int32_t mine = lane < n ? tokens[i0 + lane] : 0;
        for (int u0 = 0; u0 < n; u0 += kPrefetch) {
          Row<In, kVec> rows[kPrefetch];
          int32_t t[kPrefetch];
#pragma unroll
          for (int u = 0; u < kPrefetch; ++u) {
            t[u] = __shfl_sync(kFullMask, mine, u0 + u);
            const typename In::Bits* p = src + t[u] * D;
            if (u0 + u >= n) {
#pragma unroll
              for (int w = 0; w < Row<In, kVec>::kWords; ++w) rows[u].v[w] = make_uint4(0, 0, 0, 0);
            } else if (whole) {
#pragma unroll
              for (int w = 0; w < Row<In, kVec>::kWords; ++w)
                rows[u].v[w] = __ldg(reinterpret_cast<const uint4*>(p) + w);
            } else {
#pragma unroll
              for (int j = 0; j < kVec; ++j) rows[u].e[j] = j < cols ? p[j] : typename In::Bits(0);
            }
          }
#pragma unroll
          for (int u = 0; u < kPrefetch; ++u) {
            if (u0 + u < n) {  // uniform over the warp
              const int32_t c = t[u] / chunk_tokens;
              if (c != chunk) {
                tree.push(chunk, acc);
#pragma unroll
                for (int j = 0; j < kVec; ++j) acc[j] = 0.0f;
                chunk = c;
              }
#pragma unroll
              for (int j = 0; j < kVec; ++j) acc[j] = detmath::add(acc[j], In::load(rows[u].e[j]));
            }
          }
        }
      }
      tree.push(chunk, acc);
      tree.root(result);
    }
    typename Out::Bits* dst = out + seg * D + col0;
    if (whole) {
      Row<Out, kVec> r;
#pragma unroll
      for (int j = 0; j < kVec; ++j) r.e[j] = Out::store(result[j]);
#pragma unroll
      for (int w = 0; w < Row<Out, kVec>::kWords; ++w) reinterpret_cast<uint4*>(dst)[w] = r.v[w];
    } else {
      for (int j = 0; j < cols; ++j) dst[j] = Out::store(result[j]);
    }
  }
}

template <typename In, typename Out>
void LaunchSegmentSum(cudaStream_t stream, const void* data, const int32_t* sorted_ids, const int32_t* order,
                      int32_t* offsets, void* out, const SegmentSumShape& s) {
  const int64_t count = s.L * (s.V + 1);
  const int64_t offset_blocks =
      std::max<int64_t>(1, std::min<int64_t>((count + kThreads - 1) / kThreads, int64_t{current_sm_count()} * 16));
  SegmentOffsetsKernel<<<static_cast<unsigned>(offset_blocks), kThreads, 0, stream>>>(sorted_ids, offsets, s.T,
                                                                                      s.V, count);
  constexpr int64_t kVec = 16 / sizeof(typename In::Bits);
  const int64_t tiles = (s.D + 32 * kVec - 1) / (32 * kVec);
  const int64_t tasks = s.L * s.V * tiles;
  // 16-byte rows: D a multiple of kVec and both buffers 16-byte aligned (XLA's buffers are).
  const bool vectors =
      s.D % kVec == 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const int64_t wanted = (tasks + kWarps - 1) / kWarps;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{current_sm_count()} * 32));
  const int32_t chunk = static_cast<int32_t>(std::min<int64_t>(s.chunk_tokens, INT32_MAX));
  SegmentSumKernel<In, Out><<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(
      static_cast<const typename In::Bits*>(data), order, offsets, static_cast<typename Out::Bits*>(out), s.T, s.D,
      s.V, chunk, tiles, tasks, vectors);
}

ffi::Error SegmentSumCuda(cudaStream_t stream, ffi::AnyBuffer data, ffi::Buffer<ffi::S32> sorted_ids,
                          ffi::Buffer<ffi::S32> order, ffi::Result<ffi::AnyBuffer> out,
                          ffi::Result<ffi::AnyBuffer> workspace, int64_t chunk_tokens) {
  SegmentSumShape s;
  if (auto err = check_segment_sum_args(data, sorted_ids, order, *out, chunk_tokens, s); !err.success())
    return err;
  if (s.L == 0 || s.V == 0 || s.D == 0) return ffi::Error::Success();
  if (workspace->size_bytes() < static_cast<size_t>(s.L * (s.V + 1)) * sizeof(int32_t)) {
    return ffi::Error::InvalidArgument("jaxdet_segment_sum: the workspace must hold L * (V + 1) int32 offsets");
  }
  int32_t* offsets = static_cast<int32_t*>(workspace->untyped_data());
  JAXDET_DISPATCH_SEGMENT_SUM(data.element_type(), out->element_type(),
                              (LaunchSegmentSum<In, Out>(stream, data.untyped_data(), sorted_ids.typed_data(),
                                                         order.typed_data(), offsets, out->untyped_data(), s)));
  return last_launch_error("jaxdet_segment_sum");
}

}  // namespace
}  // namespace embed

// The handler only launches kernels on XLA's stream (no sync, allocation or host read of device
// data; its scratch is a workspace result), so XLA may record it into its command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdet_segment_sum_cuda, embed::SegmentSumCuda,
    embed::bind_segment_sum_attrs(
        embed::bind_segment_sum_buffers(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
            .Ret<ffi::AnyBuffer>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxdet
