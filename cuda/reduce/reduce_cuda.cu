// CUDA target of jaxdet_reduce: x [A, K, B] -> out [A, B], the canonical sum over K (reduce_ffi.h,
// docs/reduce.md). Every chain of the rule (one output's elements of one chunk, folded in ascending
// k from +0) is folded by one thread, alone, in order; so the bits depend on the elements only,
// never on A, B, the grid, the tile sizes or the multiprocessor count, which choose only how the
// chains are spread. No atomics.
//
// A unit of work is (a tile of outputs, one chunk); a CTA walks its units' elements through a
// pipeline of shared-memory stages filled by every thread with cp.async (16-byte pieces where the
// rows allow, 4-byte ones or element by element otherwise), so the global reads are coalesced and
// many bytes are in flight while the folding threads add:
// * ColumnKernel (B > 1): a tile is `width` consecutive b of one a; a stage holds `rows` rows of
//   them (coalesced along b); thread j folds column j.
// * RowKernel (B == 1): a tile is `rows` consecutive a; a stage holds `width` consecutive k of each
//   row (coalesced along k, rows padded by 16 bytes so that the folding threads' 16-byte reads of
//   their own rows hit distinct banks); thread r folds row r.
// The tile is chosen so that the units fill the GPU (at least two CTAs per multiprocessor where the
// outputs and chunks allow). With one chunk a unit writes its output, cast once. With several, the
// units write float32 partials to the workspace [chunks, A, B] and CombineKernel reduces each
// output's partials by the canonical tree (detmath::tree_fold), casting once.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/cuda_common.h"
#include "common/det_math.h"
#include "common/mma_sm80.cuh"  // cp_async16, cp_async_commit, cp_async_wait
#include "reduce/reduce_ffi.h"

namespace jaxdet {
namespace {

namespace dm = ::jaxdet::detmath;
using reduce::Dims;

constexpr int kThreads = 256;
constexpr int kStageBytes = 8192;  // the elements of one pipeline stage (rows add 16 bytes of padding)
constexpr int kColumnStages = 6;   // 48 KiB of shared memory: the most without an opt-in
constexpr int kRowStages = 4;      // (8 KiB + padding) each
constexpr int kUnroll = 8;         // a column's rows read ahead of its adds

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

// 4 bytes from global to shared memory (both 4-byte aligned).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(addr), "l"(gmem));
}

// One piece of kCopy bytes (16 or 4), or one element (kCopy == 0, a synchronous copy).
template <int kCopy, typename Bits>
__device__ __forceinline__ void copy_piece(unsigned char* dst, const Bits* src) {
  if constexpr (kCopy == 16) {
    cp_async16(dst, src, true);
  } else if constexpr (kCopy == 4) {
    cp_async4(dst, src);
  } else {
    *reinterpret_cast<Bits*>(dst) = *src;
  }
}

struct ColumnArgs {
  const void* x;
  void* out;
  float* partials;  // [chunks, A, B] when chunks > 1
  int64_t A, K, B, chunk, chunks;
  int64_t tiles;  // column tiles per a: ceil(B / width)
  int width;      // columns per tile, a power of two in [16, 256]: the folding threads
  int rows;       // rows per stage: kStageBytes / (width * element size)
};

template <typename S, typename O, int kCopy>
__global__ void __launch_bounds__(kThreads) ColumnKernel(ColumnArgs p) {
  using Bits = typename S::Bits;
  constexpr int kE = sizeof(Bits);
  constexpr int kPer = kCopy > 0 ? kCopy / kE : 1;  // elements per copied piece
  extern __shared__ __align__(16) unsigned char smem[];
  const int t = threadIdx.x;
  const int64_t units = p.A * p.tiles * p.chunks;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t tile = u % p.tiles, rest = u / p.tiles;
    const int64_t a = rest % p.A, c = rest / p.A;
    const int64_t b0 = tile * p.width;
    const int64_t k0 = c * p.chunk;
    const int64_t n = imin(p.K, k0 + p.chunk) - k0;  // rows of this chunk
    const int64_t stages = (n + p.rows - 1) / p.rows;
    const int cols = static_cast<int>(imin(p.width, p.B - b0));
    const Bits* src = static_cast<const Bits*>(p.x) + (a * p.K + k0) * p.B + b0;
    // Stage s (rows [s * rows, ...) of the chunk) into buffer s % kColumnStages; always one
    // commit group per call, empty past the last stage. Pieces never straddle column B: with
    // kCopy > 0 the host has checked that B is a multiple of kPer.
    auto load = [&](int64_t s) {
      if (s < stages) {
        unsigned char* buf = smem + (s % kColumnStages) * kStageBytes;
        const int64_t r0 = s * p.rows;
        const int here = static_cast<int>(imin(p.rows, n - r0));
        const int per_row = p.width / kPer;
        for (int i = t; i < here * per_row; i += kThreads) {
          const int r = i / per_row, col = (i % per_row) * kPer;
          if (col < cols) copy_piece<kCopy>(buf + (r * p.width + col) * kE, src + (r0 + r) * p.B + col);
        }
      }
      cp_async_commit();
    };
    for (int s = 0; s < kColumnStages - 1; ++s) load(s);
    float acc = 0.0f;
    for (int64_t s = 0; s < stages; ++s) {
      cp_async_wait<kColumnStages - 2>();  // this thread's pieces of stage s have landed
      __syncthreads();                     // everyone's, and stage s - 1's buffer is folded
      load(s + kColumnStages - 1);
      if (t < cols) {
        const Bits* col = reinterpret_cast<const Bits*>(smem + (s % kColumnStages) * kStageBytes) + t;
        const int here = static_cast<int>(imin(p.rows, n - s * p.rows));
        // Rows in groups of kUnroll, the next group's shared-memory reads issued before the
        // current group's adds (the adds are one dependent chain: they set the pace).
        int r = 0;
        if (here >= kUnroll) {
          Bits cur[kUnroll];
#pragma unroll
          for (int j = 0; j < kUnroll; ++j) cur[j] = col[j * p.width];
          for (r = kUnroll; r + kUnroll <= here; r += kUnroll) {
            Bits next[kUnroll];
#pragma unroll
            for (int j = 0; j < kUnroll; ++j) next[j] = col[(r + j) * p.width];
#pragma unroll
            for (int j = 0; j < kUnroll; ++j) acc = dm::add(acc, S::load(cur[j]));
#pragma unroll
            for (int j = 0; j < kUnroll; ++j) cur[j] = next[j];
          }
#pragma unroll
          for (int j = 0; j < kUnroll; ++j) acc = dm::add(acc, S::load(cur[j]));  // rows r - kUnroll .. r - 1
        }
        for (; r < here; ++r) acc = dm::add(acc, S::load(col[r * p.width]));
      }
    }
    cp_async_wait<0>();
    if (t < cols) {
      const int64_t o = a * p.B + b0 + t;
      if (p.chunks == 1) {
        static_cast<typename O::Bits*>(p.out)[o] = O::store(acc);
      } else {
        p.partials[c * p.A * p.B + o] = acc;
      }
    }
    __syncthreads();  // the next unit's first stages reuse the buffers
  }
}

struct RowArgs {
  const void* x;
  void* out;
  float* partials;  // [chunks, A] when chunks > 1
  int64_t A, K, chunk, chunks;
  int64_t tiles;  // row tiles: ceil(A / rows)
  int rows;       // rows per tile, a power of two in [8, 128]: the folding threads
  int width;      // elements of each row per stage: kStageBytes / (rows * element size)
  int pitch;      // bytes between rows in a stage: width * element size + 16
};

template <typename S, typename O, int kCopy>
__global__ void __launch_bounds__(kThreads) RowKernel(RowArgs p) {
  using Bits = typename S::Bits;
  constexpr int kE = sizeof(Bits);
  constexpr int kPer = kCopy > 0 ? kCopy / kE : 1;
  constexpr int kVecElems = 16 / kE;  // elements per 16-byte shared-memory read
  extern __shared__ __align__(16) unsigned char smem[];
  const int t = threadIdx.x;
  const int stage_bytes = p.rows * p.pitch;
  const int64_t units = p.tiles * p.chunks;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t tile = u % p.tiles, c = u / p.tiles;
    const int64_t a0 = tile * p.rows;
    const int valid_rows = static_cast<int>(imin(p.rows, p.A - a0));
    const int64_t k0 = c * p.chunk;
    const int64_t n = imin(p.K, k0 + p.chunk) - k0;  // elements of each row in this chunk
    const int64_t stages = (n + p.width - 1) / p.width;
    const Bits* src = static_cast<const Bits*>(p.x) + a0 * p.K + k0;
    // With kCopy > 0 the host has checked that K is a multiple of kPer, so n and every stage's
    // count are too: pieces are whole.
    auto load = [&](int64_t s) {
      if (s < stages) {
        unsigned char* buf = smem + (s % kRowStages) * stage_bytes;
        const int64_t e0 = s * p.width;
        const int here = static_cast<int>(imin(p.width, n - e0));
        const int per_row = p.width / kPer;
        for (int i = t; i < valid_rows * per_row; i += kThreads) {
          const int r = i / per_row, col = (i % per_row) * kPer;
          if (col < here) copy_piece<kCopy>(buf + r * p.pitch + col * kE, src + r * p.K + e0 + col);
        }
      }
      cp_async_commit();
    };
    for (int s = 0; s < kRowStages - 1; ++s) load(s);
    float acc = 0.0f;
    for (int64_t s = 0; s < stages; ++s) {
      cp_async_wait<kRowStages - 2>();
      __syncthreads();
      load(s + kRowStages - 1);
      if (t < valid_rows) {
        const unsigned char* row = smem + (s % kRowStages) * stage_bytes + t * p.pitch;
        const int here = static_cast<int>(imin(p.width, n - s * p.width));
        // 16-byte vectors of the row, the next one read before the current one's adds.
        auto add_vector = [&](const uint4& v) {
          Bits b[kVecElems];
          memcpy(b, &v, sizeof(v));
#pragma unroll
          for (int j = 0; j < kVecElems; ++j) acc = dm::add(acc, S::load(b[j]));
        };
        int e = 0;
        if (here >= kVecElems) {
          uint4 cur = *reinterpret_cast<const uint4*>(row);
          for (e = kVecElems; e + kVecElems <= here; e += kVecElems) {
            const uint4 next = *reinterpret_cast<const uint4*>(row + e * kE);
            add_vector(cur);
            cur = next;
          }
          add_vector(cur);  // elements e - kVecElems .. e - 1
        }
        for (; e < here; ++e) acc = dm::add(acc, S::load(reinterpret_cast<const Bits*>(row)[e]));
      }
    }
    cp_async_wait<0>();
    if (t < valid_rows) {
      if (p.chunks == 1) {
        static_cast<typename O::Bits*>(p.out)[a0 + t] = O::store(acc);
      } else {
        p.partials[c * p.A + a0 + t] = acc;
      }
    }
    __syncthreads();
  }
}

// out[e] = the canonical tree over partials[0 .. chunks)[e], cast once.
template <typename O>
__global__ void __launch_bounds__(kThreads)
    CombineKernel(const float* __restrict__ partials, typename O::Bits* __restrict__ out, int64_t n,
                  int64_t chunks) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x) {
    const float root = dm::tree_fold<float>(
        chunks, [&](int64_t c) { return partials[c * n + e]; }, [](float l, float r) { return dm::add(l, r); });
    out[e] = O::store(root);
  }
}

unsigned grid_of(int64_t units) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(units, 1 << 30)));
}

// The largest power of two in [lo, hi] (hi a power of two) whose unit count reaches `target`, else lo.
template <typename Units>
int pick(int lo, int hi, int64_t target, Units units) {
  for (int v = hi; v > lo; v /= 2) {
    if (units(v) >= target) return v;
  }
  return lo;
}

int pow2_at_least(int64_t n, int lo, int hi) {
  int v = lo;
  while (v < hi && v < n) v *= 2;
  return v;
}

// The widest copy the rows allow: 16- or 4-byte pieces need the base and every row start aligned.
int copy_bytes(const void* x, int64_t row_bytes) {
  const auto base = reinterpret_cast<uintptr_t>(x);
  if (base % 16 == 0 && row_bytes % 16 == 0) return 16;
  if (base % 4 == 0 && row_bytes % 4 == 0) return 4;
  return 0;
}

template <typename S, typename O>
void Launch(cudaStream_t stream, const void* x, void* out, float* partials, const Dims& d) {
  constexpr int kE = sizeof(typename S::Bits);
  const int64_t target = int64_t{2} * current_sm_count();
  if (d.B == 1) {
    RowArgs p{x, out, partials, d.A, d.K, d.chunk, d.chunks, 0, 0, 0, 0};
    const int hi = pow2_at_least(d.A, 8, 128);
    p.rows = pick(8, hi, target, [&](int r) { return (d.A + r - 1) / r * d.chunks; });
    p.tiles = (d.A + p.rows - 1) / p.rows;
    p.width = kStageBytes / (p.rows * kE);
    p.pitch = p.width * kE + 16;
    const size_t smem = static_cast<size_t>(kRowStages) * p.rows * p.pitch;
    const unsigned grid = grid_of(p.tiles * d.chunks);
    switch (copy_bytes(x, d.K * kE)) {
      case 16: RowKernel<S, O, 16><<<grid, kThreads, smem, stream>>>(p); break;
      case 4: RowKernel<S, O, 4><<<grid, kThreads, smem, stream>>>(p); break;
      default: RowKernel<S, O, 0><<<grid, kThreads, smem, stream>>>(p); break;
    }
  } else {
    ColumnArgs p{x, out, partials, d.A, d.K, d.B, d.chunk, d.chunks, 0, 0, 0};
    const int hi = pow2_at_least(d.B, 16, 256);
    p.width = pick(16, hi, target, [&](int w) { return d.A * ((d.B + w - 1) / w) * d.chunks; });
    p.tiles = (d.B + p.width - 1) / p.width;
    p.rows = kStageBytes / (p.width * kE);
    const size_t smem = static_cast<size_t>(kColumnStages) * kStageBytes;
    const unsigned grid = grid_of(d.A * p.tiles * d.chunks);
    switch (copy_bytes(x, d.B * kE)) {
      case 16: ColumnKernel<S, O, 16><<<grid, kThreads, smem, stream>>>(p); break;
      case 4: ColumnKernel<S, O, 4><<<grid, kThreads, smem, stream>>>(p); break;
      default: ColumnKernel<S, O, 0><<<grid, kThreads, smem, stream>>>(p); break;
    }
  }
  if (d.chunks > 1) {
    const int64_t n = d.outputs();
    const unsigned grid = static_cast<unsigned>(
        std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{current_sm_count()} * 16)));
    CombineKernel<O><<<grid, kThreads, 0, stream>>>(partials, static_cast<typename O::Bits*>(out), n, d.chunks);
  }
}

ffi::Error ReduceCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::AnyBuffer> workspace, int64_t chunk) {
  constexpr const char* kOp = "jaxdet_reduce";
  Dims d;
  if (auto err = reduce::dims_of(x, *out, chunk, d, kOp); !err.success()) return err;
  if (static_cast<int64_t>(workspace->size_bytes()) < reduce::workspace_bytes(d)) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": workspace too small");
  }
  return reduce::dispatch(x.element_type(), out->element_type(), kOp, [&](auto s, auto o) {
    using S = decltype(s);
    using O = decltype(o);
    if (d.outputs() == 0) return ffi::Error::Success();
    if (d.K == 0) {  // nothing to add: +0 (all-zero bits in every dtype)
      const cudaError_t err = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
      return err == cudaSuccess ? ffi::Error::Success() : cuda_error(kOp, err);
    }
    float* partials = d.chunks > 1 ? static_cast<float*>(workspace->untyped_data()) : nullptr;
    Launch<S, O>(stream, x.untyped_data(), out->untyped_data(), partials, d);
    return last_launch_error(kOp);
  });
}

}  // namespace

// Kernels and cudaMemsetAsync on XLA's stream only (the partials are a workspace result), so XLA
// may record the handler into its command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_reduce_cuda, ReduceCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // x [A, K, B]
                                  .Ret<ffi::AnyBuffer>()  // out [A, B]
                                  .Ret<ffi::AnyBuffer>()  // workspace: float32 [chunks, A, B] or unused
                                  .Attr<int64_t>("chunk"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxdet
