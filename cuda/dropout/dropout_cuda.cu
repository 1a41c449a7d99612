// CUDA targets of the Philox block function and of dropout. Each thread owns whole 16-byte chunks
// aligned to the global element index, so every Philox block is hashed exactly once and all 4 of
// its words are used; the launch grid only decides who computes a block, never what it holds.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_common.h"
#include "common/philox.h"
#include "dropout/dropout_ffi.h"

namespace jaxdet {
namespace {

constexpr int kThreads = 256;

// A group's 64-bit offset, read from device memory (a traced offset is an operand, not an attribute).
__device__ __forceinline__ uint64_t group_offset(const uint32_t* offsets, int64_t g) {
  return static_cast<uint64_t>(offsets[2 * g]) | (static_cast<uint64_t>(offsets[2 * g + 1]) << 32);
}

__global__ void PhiloxKernel(const uint4* __restrict__ counters, const uint32_t* __restrict__ keys,
                             uint4* __restrict__ out, int64_t blocks_per_group, int64_t groups) {
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    const uint32_t k0 = keys[2 * g], k1 = keys[2 * g + 1];
    const uint4* src = counters + g * blocks_per_group;
    uint4* dst = out + g * blocks_per_group;
    for (int64_t b = blockIdx.x * int64_t{kThreads} + threadIdx.x; b < blocks_per_group;
         b += int64_t{gridDim.x} * kThreads) {
      const uint4 c = src[b];
      const Philox4 r = philox4x32_10(c.x, c.y, c.z, c.w, k0, k1);
      dst[b] = make_uint4(r.v[0], r.v[1], r.v[2], r.v[3]);
    }
  }
}

// A chunk is kVec consecutive global indices starting at a multiple of kVec (16 bytes of data).
template <typename Storage>
struct Chunk {
  using Bits = typename Storage::Bits;
  static constexpr int kVec = 16 / sizeof(Bits);
  static constexpr int kBlocks = kVec / 4;
  union Vec {
    uint4 raw;
    Bits e[kVec];
  };
};

// Each thread takes kUnroll chunks a grid-stride apart and issues all their loads before any
// hashing, so enough bytes are in flight to cover memory latency while the Philox math runs.
// Three resident blocks per SM (<= 80 registers, no spills; measured: 2 blocks left the
// schedulers idle 44% of the time).
constexpr int kUnroll = 4;
constexpr int kMinBlocksPerSm = 3;

template <typename Storage>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    DropoutKernel(const typename Storage::Bits* __restrict__ x, typename Storage::Bits* __restrict__ y,
                  int64_t per_group, int64_t groups, const uint32_t* __restrict__ keys,
                  const uint32_t* __restrict__ offsets, uint32_t drop_threshold, float scale) {
  using C = Chunk<Storage>;
  using Bits = typename Storage::Bits;
  constexpr int kVec = C::kVec;
  const int64_t stride = int64_t{gridDim.x} * kThreads;
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    const uint32_t k0 = keys[2 * g], k1 = keys[2 * g + 1];
    const uint64_t offset = group_offset(offsets, g);
    const uint64_t first_chunk = offset / kVec;
    const int64_t lead = static_cast<int64_t>(offset % kVec);  // elements of chunk 0 before x[0]
    const int64_t chunks = (lead + per_group + kVec - 1) / kVec;
    const Bits* src = x + g * per_group;
    Bits* dst = y + g * per_group;
    // Whole 16-byte vectors need 16-byte aligned addresses; the offset of a group's data from
    // alignment is the same for every chunk of the group.
    const uintptr_t lead_bytes = static_cast<uintptr_t>(lead) * sizeof(Bits);
    const bool aligned =
        (((reinterpret_cast<uintptr_t>(src) - lead_bytes) | (reinterpret_cast<uintptr_t>(dst) - lead_bytes)) %
         16) == 0;
    for (int64_t j0 = blockIdx.x * int64_t{kThreads} + threadIdx.x; j0 < chunks; j0 += stride * kUnroll) {
      typename C::Vec v[kUnroll];
      bool whole[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = j0 + u * stride;
        const int64_t start = j * kVec - lead;
        whole[u] = aligned && j < chunks && start >= 0 && start + kVec <= per_group;
        if (whole[u]) v[u].raw = __ldcs(reinterpret_cast<const uint4*>(src + start));
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t j = j0 + u * stride;
        if (j >= chunks) break;
        const int64_t start = j * kVec - lead;  // local index of the chunk's first element
        const uint64_t block0 = (first_chunk + j) * C::kBlocks;
        Philox4 r[C::kBlocks];
#pragma unroll
        for (int p = 0; p < C::kBlocks; ++p) r[p] = dropout_block(block0 + p, k0, k1);
        if (whole[u]) {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            v[u].e[e] =
                dropout_element<Storage>(v[u].e[e], dropout_keep(r[e / 4].v[e % 4], drop_threshold), scale);
          }
          __stcs(reinterpret_cast<uint4*>(dst + start), v[u].raw);
        } else {
#pragma unroll
          for (int e = 0; e < kVec; ++e) {
            const int64_t i = start + e;
            if (i >= 0 && i < per_group) {
              dst[i] = dropout_element<Storage>(src[i], dropout_keep(r[e / 4].v[e % 4], drop_threshold), scale);
            }
          }
        }
      }
    }
  }
}

// broadcast_dims: one element per thread, mask index through the layout. Neighbouring threads
// usually hash the same block (a little redundant work on a path that is not bandwidth-critical).
template <typename Storage>
__global__ void __launch_bounds__(kThreads)
    DropoutStridedKernel(const typename Storage::Bits* __restrict__ x, typename Storage::Bits* __restrict__ y,
                         int64_t per_group, int64_t groups, const uint32_t* __restrict__ keys,
                         const uint32_t* __restrict__ offsets, const MaskLayout layout, uint32_t drop_threshold,
                         float scale) {
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    const uint32_t k0 = keys[2 * g], k1 = keys[2 * g + 1];
    const uint64_t offset = group_offset(offsets, g);
    const typename Storage::Bits* src = x + g * per_group;
    typename Storage::Bits* dst = y + g * per_group;
    for (int64_t i = blockIdx.x * int64_t{kThreads} + threadIdx.x; i < per_group;
         i += int64_t{gridDim.x} * kThreads) {
      const uint64_t index = mask_index(i, layout) + offset;
      const Philox4 r = dropout_block(index / 4, k0, k1);
      const uint32_t word = philox_word(r, static_cast<int>(index % 4));
      dst[i] = dropout_element<Storage>(src[i], dropout_keep(word, drop_threshold), scale);
    }
  }
}

dim3 GridFor(int64_t items_per_group, int64_t groups) {
  const int64_t wanted = (items_per_group + kThreads - 1) / kThreads;
  const int64_t cap = int64_t{current_sm_count()} * 8;
  const int64_t gx = std::max<int64_t>(1, std::min(wanted, cap));
  const int64_t gy = std::max<int64_t>(1, std::min<int64_t>(groups, std::max<int64_t>(1, cap / gx)));
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(std::min<int64_t>(gy, 65535)));
}

ffi::Error PhiloxCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> counters, ffi::Buffer<ffi::U32> keys,
                      ffi::ResultBuffer<ffi::U32> out) {
  const int64_t groups = key_group_count(keys);
  const int64_t blocks = static_cast<int64_t>(counters.element_count() / 4);
  if (auto err = check_key_groups(blocks, groups, "jaxdet_philox4x32_10"); !err.success()) return err;
  if (blocks == 0) return ffi::Error::Success();
  const int64_t per_group = blocks / groups;
  PhiloxKernel<<<GridFor(per_group, groups), kThreads, 0, stream>>>(
      reinterpret_cast<const uint4*>(counters.typed_data()), keys.typed_data(),
      reinterpret_cast<uint4*>(out->typed_data()), per_group, groups);
  return last_launch_error("jaxdet_philox4x32_10");
}

template <typename Storage>
void LaunchDropout(cudaStream_t stream, const void* x, void* y, int64_t per_group, int64_t groups,
                   const uint32_t* keys, const uint32_t* offsets, const MaskLayout& layout,
                   uint32_t drop_threshold, float scale) {
  using Bits = typename Storage::Bits;
  if (layout.rank > 0) {
    DropoutStridedKernel<Storage><<<GridFor(per_group, groups), kThreads, 0, stream>>>(
        static_cast<const Bits*>(x), static_cast<Bits*>(y), per_group, groups, keys, offsets, layout,
        drop_threshold, scale);
    return;
  }
  // The offsets live in device memory, so the grid covers the most chunks any alignment needs
  // (a group's first chunk may start up to kVec - 1 elements before x[0]).
  constexpr int kVec = Chunk<Storage>::kVec;
  const int64_t chunks = (kVec - 1 + per_group + kVec - 1) / kVec;
  DropoutKernel<Storage><<<GridFor(chunks, groups), kThreads, 0, stream>>>(
      static_cast<const Bits*>(x), static_cast<Bits*>(y), per_group, groups, keys, offsets, drop_threshold, scale);
}

ffi::Error DropoutCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> keys,
                       ffi::Buffer<ffi::U32> offsets, ffi::Result<ffi::AnyBuffer> y, uint32_t drop_threshold,
                       float scale, ffi::Span<const int64_t> mask_strides) {
  DropoutShape shape;
  if (auto err = check_dropout_args(x, keys, offsets, mask_strides, shape); !err.success()) return err;
  if (shape.n == 0) return ffi::Error::Success();
  JAXDET_DISPATCH_FLOAT(
      x.element_type(), "jaxdet_dropout", "x",
      LaunchDropout<S>(stream, x.untyped_data(), y->untyped_data(), shape.per_group, shape.groups,
                       keys.typed_data(), offsets.typed_data(), shape.layout, drop_threshold, scale));
  return last_launch_error("jaxdet_dropout");
}

}  // namespace

// Both handlers only launch kernels on XLA's stream (no sync, allocation or host read of device
// data), so XLA may record them into its command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_philox_cuda, PhiloxCuda,
                              bind_philox(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_dropout_cuda, DropoutCuda,
                              bind_dropout(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxdet
