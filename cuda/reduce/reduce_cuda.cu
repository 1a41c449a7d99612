// CUDA target of jaxdet_reduce: x [A, K, B] -> out [A, B], the canonical sum over K (reduce_ffi.h,
// docs/reduce.md). Every chain of the rule (one output's elements of one chunk, folded in ascending
// k from +0) is folded by one thread, alone, in order; so the bits depend on the elements only,
// never on A, B, the grid, the tile sizes or the multiprocessor count, which choose only how the
// chains are spread. No atomics.
//
// A unit of work is a tile of chains; a CTA of 256 threads walks its unit's elements through four
// 16 KiB shared-memory stages (three in flight while one is folded) filled by every thread with
// cp.async (16-byte pieces where the rows allow, 4-byte ones or element by element otherwise), so
// the global reads are coalesced and many bytes are in flight while the folding threads add:
// * ColumnKernel (B > 1): a tile is `width` consecutive b of one a and one chunk; a stage holds
//   `rows` rows of them (coalesced along b); thread j folds column j.
// * RowKernel (B == 1): a tile is `rows` consecutive chains (a, chunk), the chunk fastest (so one
//   long row is several chains); a stage holds the next `width` elements of each (coalesced along
//   k, their 16-byte granules swizzled so that the folding threads' reads hit distinct banks);
//   thread r folds chain r.
// The tile is the narrowest whose CTAs fit in one wave (by the occupancy), else the widest. With
// one chunk a chain writes its output, cast once. With several, the chains write float32 partials
// to the workspace [chunks, A, B], and CombineKernel (one thread per output) or CombineWideKernel
// (one CTA per output, for few outputs) reduces each output's partials by the canonical tree,
// casting once.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
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
constexpr int kStageBytes = 16384;  // one pipeline stage of elements
constexpr int kStages = 4;          // three stages in flight while one is folded
constexpr int kUnroll = 8;          // a column's rows read ahead of its adds
constexpr int kMaxRows = 128;       // chains of a RowKernel tile

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
  int width;  // columns per tile, a power of two in [16, 256]
  int rows;  // rows per stage: kStageBytes / (width * element size)
};

// B > 1. Unit u = (chunk, a, column tile), the tile fastest; the chain of column j is
// x[a, chunk, b0 + j], folded by one thread.
template <typename S, typename O, int kCopy>
__global__ void __launch_bounds__(kThreads) ColumnKernel(ColumnArgs p) {
  using Bits = typename S::Bits;
  constexpr int kE = sizeof(Bits);
  constexpr int kPer = kCopy > 0 ? kCopy / kE : 1;  // elements per copied piece
  extern __shared__ __align__(16) unsigned char smem[];
  const int t = threadIdx.x;
  const int per_row = p.width / kPer;  // pieces per stage row, a power of two
  const int shift = __ffs(per_row) - 1;
  const int64_t units = p.A * p.tiles * p.chunks;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t tile = u % p.tiles, rest = u / p.tiles;
    const int64_t a = rest % p.A, c = rest / p.A;
    const int64_t b0 = tile * p.width;
    const int64_t k0 = c * p.chunk;
    const int64_t n = imin(p.K, k0 + p.chunk) - k0;  // rows of this chunk
    const int64_t stages = (n + p.rows - 1) / p.rows;
    const int cols = static_cast<int>(imin(p.width, p.B - b0));
    const int j = t < cols ? t : -1;  // the column this thread folds
    const Bits* src = static_cast<const Bits*>(p.x) + (a * p.K + k0) * p.B + b0;
    // Stage s (rows [s * rows, ...) of the chunk) into buffer s % kStages, by every thread; one
    // commit group per call, empty past the last stage. With kCopy > 0 the host has checked that B
    // is a multiple of kPer, so a piece is all columns < cols or all beyond.
    auto load = [&](int64_t s) {
      if (s < stages) {
        unsigned char* buf = smem + (s % kStages) * kStageBytes;
        const int64_t r0 = s * p.rows;
        const int here = static_cast<int>(imin(p.rows, n - r0));
        for (int i = t; i < (here << shift); i += kThreads) {
          const int r = i >> shift, col = (i & (per_row - 1)) * kPer;
          if (col < cols) copy_piece<kCopy>(buf + (r * p.width + col) * kE, src + (r0 + r) * p.B + col);
        }
      }
      cp_async_commit();
    };
    for (int s = 0; s < kStages - 1; ++s) load(s);
    float acc = 0.0f;
    for (int64_t s = 0; s < stages; ++s) {
      cp_async_wait<kStages - 2>();  // this thread's pieces of stage s have landed
      __syncthreads();  // everyone's, and stage s - 1's buffer is folded
      load(s + kStages - 1);
      if (j >= 0) {
        const Bits* col = reinterpret_cast<const Bits*>(smem + (s % kStages) * kStageBytes) + j;
        const int here = static_cast<int>(imin(p.rows, n - s * p.rows));
        // Rows in groups of kUnroll, the next group's shared-memory reads issued before the
        // current group's adds (the adds are one dependent chain: they set the pace).
        int r = 0;
        if (here >= kUnroll) {
          Bits cur[kUnroll];
#pragma unroll
          for (int q = 0; q < kUnroll; ++q) cur[q] = col[q * p.width];
          for (r = kUnroll; r + kUnroll <= here; r += kUnroll) {
            Bits next[kUnroll];
#pragma unroll
            for (int q = 0; q < kUnroll; ++q) next[q] = col[(r + q) * p.width];
#pragma unroll
            for (int q = 0; q < kUnroll; ++q) acc = dm::add(acc, S::load(cur[q]));
#pragma unroll
            for (int q = 0; q < kUnroll; ++q) cur[q] = next[q];
          }
#pragma unroll
          for (int q = 0; q < kUnroll; ++q) acc = dm::add(acc, S::load(cur[q]));  // rows r - kUnroll .. r - 1
        }
        for (; r < here; ++r) acc = dm::add(acc, S::load(col[r * p.width]));
      }
    }
    cp_async_wait<0>();
    if (j >= 0) {
      const int64_t o = a * p.B + b0 + j;
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
  int64_t pairs;  // chains: A * chunks, (a, chunk) with the chunk fastest
  int64_t tiles;  // ceil(pairs / rows)
  int rows;  // chains per tile, a power of two in [8, kMaxRows]
  int width;  // elements of each chain per stage: kStageBytes / (rows * element size)
};

// Byte offset in a chain's stage row of byte `b` of its elements: the 16-byte granules XOR-swizzled
// by the chain index, so that the folding threads' 16-byte reads of eight consecutive chains' rows
// (which start on the same bank) hit distinct banks.
__device__ __forceinline__ int swizzled(int b, int r) { return (((b >> 4) ^ (r & 7)) << 4) | (b & 15); }

// B == 1. Unit u = a tile of `rows` consecutive chains (a, chunk); chain r's elements are
// x[a, chunk * C + e], folded by one thread. Each chain's part of a stage holds its next `width`
// elements (coalesced reads along k).
template <typename S, typename O, int kCopy>
__global__ void __launch_bounds__(kThreads) RowKernel(RowArgs p) {
  using Bits = typename S::Bits;
  constexpr int kE = sizeof(Bits);
  constexpr int kPiece = kCopy > 0 ? kCopy : kE;  // bytes per copied piece
  constexpr int kPer = kPiece / kE;
  constexpr int kVecElems = 16 / kE;  // elements per 16-byte shared-memory read
  extern __shared__ __align__(16) unsigned char smem[];
  int64_t* meta_src = reinterpret_cast<int64_t*>(smem + kStages * kStageBytes);  // [rows]: a * K + chunk * C
  int64_t* meta_out = meta_src + kMaxRows;  // [rows]: the output (or partial) index
  int* meta_n = reinterpret_cast<int*>(meta_out + kMaxRows);  // [rows]: the chain's element count
  const int t = threadIdx.x;
  const int payload = p.width * kE;  // bytes of a chain's stage row: a power of two >= 128
  const int per_row = payload / kPiece;
  const int shift = __ffs(per_row) - 1;
  const int64_t first = imin(p.K, p.chunk);  // the longest chain
  const int64_t stages = (first + p.width - 1) / p.width;
  for (int64_t u = blockIdx.x; u < p.tiles; u += gridDim.x) {
    const int64_t g0 = u * p.rows;
    const int valid = static_cast<int>(imin(p.rows, p.pairs - g0));
    if (t < valid) {
      const int64_t g = g0 + t, a = g / p.chunks, c = g - a * p.chunks;
      meta_src[t] = a * p.K + c * p.chunk;
      meta_out[t] = p.chunks == 1 ? a : c * p.A + a;
      meta_n[t] = static_cast<int>(imin(p.K, (c + 1) * p.chunk) - c * p.chunk);
    }
    __syncthreads();
    const int r_fold = t < valid ? t : -1;  // the chain this thread folds
    const int n_fold = r_fold >= 0 ? meta_n[r_fold] : 0;
    const Bits* x = static_cast<const Bits*>(p.x);
    // With kCopy > 0 the host has checked that K is a multiple of kPer, so every chain's count is
    // too and a piece is all inside the chain or all beyond.
    auto load = [&](int64_t s) {
      if (s < stages) {
        unsigned char* buf = smem + (s % kStages) * kStageBytes;
        const int64_t e0 = s * p.width;
        for (int i = t; i < (valid << shift); i += kThreads) {
          const int r = i >> shift, q = i & (per_row - 1);
          const int64_t e = e0 + q * kPer;
          if (e < meta_n[r]) {
            copy_piece<kCopy>(buf + r * payload + swizzled(q * kPiece, r), x + meta_src[r] + e);
          }
        }
      }
      cp_async_commit();
    };
    for (int s = 0; s < kStages - 1; ++s) load(s);
    float acc = 0.0f;
    for (int64_t s = 0; s < stages; ++s) {
      cp_async_wait<kStages - 2>();
      __syncthreads();
      load(s + kStages - 1);
      const int here = static_cast<int>(imin(p.width, n_fold - s * p.width));
      if (here > 0) {
        const unsigned char* row = smem + (s % kStages) * kStageBytes + r_fold * payload;
        // 16-byte vectors of the row, the next one read before the current one's adds.
        auto vector = [&](int e) { return *reinterpret_cast<const uint4*>(row + swizzled(e * kE, r_fold)); };
        auto add_vector = [&](const uint4& v) {
          Bits b[kVecElems];
          memcpy(b, &v, sizeof(v));
#pragma unroll
          for (int q = 0; q < kVecElems; ++q) acc = dm::add(acc, S::load(b[q]));
        };
        int e = 0;
        if (here >= kVecElems) {
          uint4 cur = vector(0);
          for (e = kVecElems; e + kVecElems <= here; e += kVecElems) {
            const uint4 next = vector(e);
            add_vector(cur);
            cur = next;
          }
          add_vector(cur);  // elements e - kVecElems .. e - 1
        }
        for (; e < here; ++e)
          acc = dm::add(acc, S::load(*reinterpret_cast<const Bits*>(row + swizzled(e * kE, r_fold))));
      }
    }
    cp_async_wait<0>();
    if (r_fold >= 0) {
      if (p.chunks == 1) {
        static_cast<typename O::Bits*>(p.out)[meta_out[r_fold]] = O::store(acc);
      } else {
        p.partials[meta_out[r_fold]] = acc;
      }
    }
    __syncthreads();  // the next unit's metadata and first stages reuse the shared memory
  }
}

constexpr size_t kColumnSmem = size_t{kStages} * kStageBytes;
constexpr size_t kRowSmem = kColumnSmem + kMaxRows * (2 * sizeof(int64_t) + sizeof(int));

// out[e] = the canonical tree over partials[0 .. chunks)[e], cast once: one thread per output,
// walking the tree with a stack (detmath::tree_fold); the threads of a warp read consecutive outputs.
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

constexpr int kCombineBlock = 2048;  // leaves a CombineWideKernel CTA reduces per pass: 8 per thread

// The same tree for few outputs of many chunks (a full reduction to a scalar): one CTA per output.
// Its chunk partials are taken in aligned blocks of kCombineBlock (complete subtrees, or the padded
// tail), each reduced level by level in shared memory as tree_sum walks the tree (neighbours
// paired, an odd last one carried up), read all at once; thread 0 merges the block roots as
// tree_fold does (a stack of complete subtrees). The same bits as CombineKernel.
template <typename O>
__global__ void __launch_bounds__(kThreads)
    CombineWideKernel(const float* __restrict__ partials, typename O::Bits* __restrict__ out, int64_t n,
                      int64_t chunks) {
  __shared__ float level[2][kCombineBlock];
  __shared__ float stack[64];
  __shared__ int64_t size[64];
  const int t = threadIdx.x;
  for (int64_t e = blockIdx.x; e < n; e += gridDim.x) {
    int top = 0;
    for (int64_t c0 = 0; c0 < chunks; c0 += kCombineBlock) {
      int count = static_cast<int>(imin(kCombineBlock, chunks - c0));
      for (int i = t; i < count; i += kThreads) level[0][i] = partials[(c0 + i) * n + e];
      __syncthreads();
      int from = 0;
      while (count > 1) {
        const int half = count / 2;
        for (int i = t; i < half; i += kThreads)
          level[from ^ 1][i] = dm::add(level[from][2 * i], level[from][2 * i + 1]);
        if (t == 0 && (count & 1)) level[from ^ 1][half] = level[from][count - 1];
        __syncthreads();
        from ^= 1;
        count = half + (count & 1);
      }
      if (t == 0) {  // push the block's root, merging complete subtrees of equal size
        float node = level[from][0];
        int64_t blocks = 1;
        while (top > 0 && size[top - 1] == blocks) {
          node = dm::add(stack[top - 1], node);
          blocks *= 2;
          --top;
        }
        stack[top] = node;
        size[top] = blocks;
        ++top;
      }
      __syncthreads();  // level[0] is refilled by the next block
    }
    if (t == 0) {
      float root = stack[top - 1];
      for (int j = top - 2; j >= 0; --j) root = dm::add(stack[j], root);
      out[e] = O::store(root);
    }
  }
}

unsigned grid_of(int64_t units) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(units, 1 << 30)));
}

// Launches kKernel with kSmem bytes of dynamic shared memory, raising its limit once per device
// (cudaFuncSetAttribute is per device; no stream work).
template <auto kKernel, size_t kSmem, typename Args>
cudaError_t launch(unsigned grid, cudaStream_t stream, const Args& args) {
  static std::atomic<uint64_t> raised{0};
  int device = 0;
  if (const cudaError_t e = cudaGetDevice(&device); e != cudaSuccess) return e;
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (!(raised.load(std::memory_order_acquire) & bit)) {
    const cudaError_t e = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (e != cudaSuccess) return e;
    raised.fetch_or(bit, std::memory_order_acq_rel);
  }
  kKernel<<<grid, kThreads, kSmem, stream>>>(args);
  return cudaGetLastError();
}

// CTAs of kKernel (with kSmem bytes of shared memory) that the device runs at once: one wave.
template <auto kKernel, size_t kSmem>
int64_t wave() {
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kThreads, kSmem) != cudaSuccess) {
    cudaGetLastError();
    per_sm = 1;
  }
  return int64_t{std::max(per_sm, 1)} * current_sm_count();
}

// The tile (a power of two in [lo, hi]) for `units(tile)` CTAs: the smallest whose CTAs fit in one
// wave (the most CTAs, so the most bytes in flight, with every chain running at once), else hi.
// Measured on an H100 against the widest tile that still gives two CTAs per multiprocessor:
// docs/reduce.md, "Kernels and cost".
template <typename Units>
int choose(int lo, int hi, int64_t wave, Units units) {
  for (int v = lo; v < hi; v *= 2) {
    if (units(v) <= wave) return v;
  }
  return hi;
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
cudaError_t Launch(cudaStream_t stream, const void* x, void* out, float* partials, const Dims& d) {
  constexpr int kE = sizeof(typename S::Bits);
  cudaError_t err = cudaSuccess;
  if (d.B == 1) {
    RowArgs p{x, out, partials, d.A, d.K, d.chunk, d.chunks, d.A * d.chunks, 0, 0, 0};
    const int copy = copy_bytes(x, d.K * kE);
    const int64_t slots = copy == 16  ? wave<RowKernel<S, O, 16>, kRowSmem>()
                          : copy == 4 ? wave<RowKernel<S, O, 4>, kRowSmem>()
                                      : wave<RowKernel<S, O, 0>, kRowSmem>();
    // A chain's part of a stage holds at least eight 16-byte granules (the swizzle).
    const int hi = pow2_at_least(p.pairs, 8, std::min(kMaxRows, kStageBytes / 128));
    p.rows = choose(8, hi, slots, [&](int r) { return (p.pairs + r - 1) / r; });
    p.tiles = (p.pairs + p.rows - 1) / p.rows;
    p.width = kStageBytes / (p.rows * kE);
    const unsigned grid = grid_of(p.tiles);
    switch (copy) {
      case 16: err = launch<RowKernel<S, O, 16>, kRowSmem>(grid, stream, p); break;
      case 4: err = launch<RowKernel<S, O, 4>, kRowSmem>(grid, stream, p); break;
      default: err = launch<RowKernel<S, O, 0>, kRowSmem>(grid, stream, p); break;
    }
  } else {
    ColumnArgs p{x, out, partials, d.A, d.K, d.B, d.chunk, d.chunks, 0, 0, 0};
    const int copy = copy_bytes(x, d.B * kE);
    const int64_t slots = copy == 16  ? wave<ColumnKernel<S, O, 16>, kColumnSmem>()
                          : copy == 4 ? wave<ColumnKernel<S, O, 4>, kColumnSmem>()
                                      : wave<ColumnKernel<S, O, 0>, kColumnSmem>();
    const int hi = pow2_at_least(d.B, 16, 256);
    p.width = choose(16, hi, slots, [&](int w) { return d.A * ((d.B + w - 1) / w) * d.chunks; });
    p.tiles = (d.B + p.width - 1) / p.width;
    p.rows = kStageBytes / (p.width * kE);
    const unsigned grid = grid_of(d.A * p.tiles * d.chunks);
    switch (copy) {
      case 16: err = launch<ColumnKernel<S, O, 16>, kColumnSmem>(grid, stream, p); break;
      case 4: err = launch<ColumnKernel<S, O, 4>, kColumnSmem>(grid, stream, p); break;
      default: err = launch<ColumnKernel<S, O, 0>, kColumnSmem>(grid, stream, p); break;
    }
  }
  if (err != cudaSuccess || d.chunks == 1) return err;
  const int64_t n = d.outputs();
  auto* dst = static_cast<typename O::Bits*>(out);
  if (n < int64_t{kThreads} * current_sm_count()) {  // too few outputs to fill the GPU one per thread
    CombineWideKernel<O><<<grid_of(n), kThreads, 0, stream>>>(partials, dst, n, d.chunks);
  } else {
    const unsigned grid = static_cast<unsigned>(
        std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{current_sm_count()} * 16)));
    CombineKernel<O><<<grid, kThreads, 0, stream>>>(partials, dst, n, d.chunks);
  }
  return cudaGetLastError();
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
    const cudaError_t err = Launch<S, O>(stream, x.untyped_data(), out->untyped_data(), partials, d);
    return err == cudaSuccess ? ffi::Error::Success() : cuda_error(kOp, err);
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
