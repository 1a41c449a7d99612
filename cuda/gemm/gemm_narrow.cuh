// The narrow few-row tiles of the Hopper forward and dA sets (16 rows by 32 or 16 columns of D): a kernel
// of their own, because the narrowest wgmma tile has 64 columns (the 16x64 tile, D^T = B^T A^T with
// B on the wgmma's 64-row side). Without split-K one CTA owns a column slice of D over all of K, so
// a 4096-wide output at M <= 16 has only 64 such CTAs on an H100's 132 SMs; 32-column slices give
// it 128, and 16-column slices give a 2048-wide output (a d-2048 model's attention output and
// down projections) 128 where 32 give 64.
//
// At M <= 16 an SM holds one such CTA: one warp per scheduler, which issues both the copies and
// the MMA chain, so the kernel's time is the instructions it spends per K tile (Nsight Compute:
// DRAM below 70% of peak, the warps' stalls mostly fixed-latency waits, none on memory). Hence each
// thread's copies use offsets fixed once per work item and source pointers that advance by one K
// tile, and the next K tile's shared-memory reads go between the accumulator's k16 steps.
//
// The bits are those of every other tile of the set (docs/matmul_cuda.md, "M buckets"): each
// element of D is one float32 accumulator fed by k16 steps of a_mk * b_kn, K tiles of 64 in
// ascending order (sm90::kTileK), zeros in the steps past K up to the last K tile's end (what TMA
// feeds the wgmma tiles), then CUTLASS's LinearCombination epilogue with no source:
// D = beta * 0 + alpha * acc (alpha = 1, beta = 0; the zero source makes an accumulator of -0 a +0)
// rounded to D's type to nearest even. The instruction is mma.sync m16n8k16 on the swapped
// operands (B^T on its 16-row side, A^T on its 8 columns), which on Hopper gives the k16 step of
// wgmma m64nNk16 bit for bit (tests/test_gemm_buckets.py proves it against every other tile on
// special values and K residues). wgmma's first step replaces the accumulator where these start
// from zero; the sums differ at most in the sign of a zero, which the epilogue's +0 erases.
//
// The chunk rule (docs/matmul.md) in one launch: with K beyond one chunk, each chunk's K tiles are
// computed exactly as a launch on that chunk's K range would, giving the float32 partial that
// launch's float32 D would hold, and the partials meet by the canonical tree (detmath::tree_fold),
// cast once like the per-chunk path's tree kernel. Every (column slice, row block, chunk) is a CTA
// of its own (split-K): each stores its partial, and the last CTA of a tile to arrive (an integer
// counter per tile: arrival order decides only who combines, never what) reads the tile's partials
// and combines them; no CTA waits for another, so any residency works. (One CTA folding all of its
// tile's chunks measured slower wherever a decode product has more than one chunk, even with the
// tiles alone filling the SMs: H200, (14336, 4096) at M = 1 with 16x32 tiles, 38.0 us against
// 34.9 split, the counters' memset included; tools/experiments/gemm_narrow_stages.cu.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <type_traits>

#include "common/det_math.h"
#include "common/mma_sm80.cuh"
#include "cutlass/layout/matrix.h"
#include "cutlass/numeric_types.h"
#include "gemm_args.h"

namespace jaxdet {
namespace gemm {
namespace narrow {

constexpr int kTileK = 64;  // the Hopper sets' K tile (sm90::kTileK in gemm_sm90.cuh), in four k16 steps

// A tile of 16 rows by TileN columns (the sets' 32 and 16; 64 for the probe's comparison on wide
// outputs, tools/experiments/gemm_narrow_stages.cu): warps of 16 columns by 8 rows each (one mma
// m16n8k16 on the swapped operands), warp w at columns 16 * (w % (TileN / 16)), rows 8 * (w /
// (TileN / 16)).
template <int TileN>
struct Tile {
  static_assert(TileN == 64 || TileN == 32 || TileN == 16, "the narrow tiles are 16x64, 16x32 and 16x16");
  static constexpr int kColumnWarps = TileN / 16;
  static constexpr int kWarps = 2 * kColumnWarps;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kATileBytes = kTileM * kTileK * 2;  // [16 m][64 k], 8 chunks per row
  static constexpr int kBRowBytes = TileN * 2;             // [64 k][TileN n], TileN / 8 chunks per row
  static constexpr int kBTileBytes = kTileK * kBRowBytes;
  static constexpr int kStageBytes = kATileBytes + kBTileBytes;
  static_assert(kBTileBytes % (16 * kThreads) == 0, "whole loads of B per thread");
  // A's 128 chunks per stage: whole loads per thread, or one for the first 128 threads of 16x64.
  static constexpr int kALoads = (kATileBytes / 16 + kThreads - 1) / kThreads;
  static_assert(kATileBytes / 16 <= kALoads * kThreads && (kATileBytes / 16) % kThreads == 0 || kALoads == 1,
                "A's chunks fit the threads' loads");
  // B's shared-memory offset (bytes, within a stage's tile) of the 16-byte chunk `chunk` of row k:
  // the chunks of a row permuted by the row's 128-byte line, so that the eight rows one ldmatrix
  // reads (one chunk each) fall in distinct banks.
  __device__ __forceinline__ static int b_offset(int k, int chunk) {
    constexpr int kRowsPerLine = 128 / kBRowBytes, kChunksPerRow = kBRowBytes / 16;
    const unsigned line = static_cast<unsigned>(k) / kRowsPerLine;  // unsigned: shifts and masks
    return k * kBRowBytes + ((chunk ^ static_cast<int>(line % kChunksPerRow)) << 4);
  }
};
// The pipeline depth: 8 stages (6 KB each at 16x32), by tools/experiments/gemm_narrow_stages.cu on
// an H100 (M = 1-16): 4 stages 35% slower on a long K, 12 stages 2-3% faster there but 5% slower on
// a wide output (2048 x 11264) that runs several CTAs per SM.
constexpr int kStages = 8;
template <int TileN, int Stages = kStages>
constexpr int kSmemBytes = Stages * Tile<TileN>::kStageBytes;

// A's shared-memory offset (bytes, within a stage's tile) of the 16-byte chunk `chunk` of row `row`
// (rows of 64 k, 128 bytes), permuted as B's are.
__device__ __forceinline__ int k_major_offset(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

// D's element from the chunk tree's root (with one chunk, the partial beta * 0 + alpha * acc that
// CUTLASS's epilogue computes with its source cleared, run-time scalars so that nothing folds):
// rounded to nearest even by the cvt instructions of that epilogue and of the per-chunk path's tree
// kernel (ChunkTreeKernel in matmul_cuda.cu).
template <class ElementD>
__device__ __forceinline__ void store_root(ElementD* p, float root) {
  if constexpr (std::is_same_v<ElementD, float>) {
    *p = root;
  } else if constexpr (std::is_same_v<ElementD, cutlass::bfloat16_t>) {
    *reinterpret_cast<__nv_bfloat16*>(p) = __float2bfloat16_rn(root);
  } else {
    static_assert(std::is_same_v<ElementD, cutlass::half_t>, "D is float32, bfloat16 or float16");
    *reinterpret_cast<__half*>(p) = __float2half_rn(root);
  }
}

struct Params {
  int64_t m, n, k, l;
  int64_t m_blocks;  // ceil(m / kTileM)
  int k_tiles;       // ceil(k / kTileK)
  const char* a;  // A row-major [M, K] (bytes; elements of 2 bytes)
  int64_t lda, batch_a;
  const char* b;  // row-major [K, N]
  int64_t ldb, batch_b;
  void* d;  // row-major [M, N]
  int64_t ldd, batch_d;
  float alpha, beta;  // 1 and 0
  // The chunk rule: K tiles per chunk and chunks (1: no chunking). With more than one, each chunk
  // is a CTA of its own: it stores its float32 partial [kThreads][4] at partials + (((l * chunks +
  // c) * m_blocks + mb) * n_tiles + tile) * kThreads * 4 and counts its arrival in one counter per
  // (l, mb, tile), zero before the launch.
  int chunk_k_tiles;
  int chunks;
  int64_t n_tiles;
  float* partials;
  int32_t* counters;
};

// kBColumns: B is stored [N, K] (dA's B, the weight read transposed in place), so its K tile is
// staged as A's is, TileN rows of 64 k, and read by ldmatrix without the transpose; otherwise [K, N].
template <class Element, class ElementD, int TileN = 32, int kStages = narrow::kStages, bool kBColumns = false>
__global__ void __launch_bounds__(Tile<TileN>::kThreads) narrow_gemm_kernel(const Params p) {
  using T = Tile<TileN>;
  constexpr int kThreads = T::kThreads, kStageBytes = T::kStageBytes, kATileBytes = T::kATileBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n0 = int64_t{blockIdx.x} * TileN;
  const int64_t m_blocks = p.m_blocks;
  const int k_tiles = p.k_tiles;
  const int warp_n = 16 * static_cast<int>(unsigned(warp) % T::kColumnWarps);
  const int warp_m = 8 * static_cast<int>(unsigned(warp) / T::kColumnWarps);

  const int64_t units = p.l * p.chunks;  // (batch, chunk) pairs, chunk fastest
  for (int64_t lc = blockIdx.z; lc < units; lc += gridDim.z) {
    const int64_t l = lc / p.chunks;
    const int c = static_cast<int>(lc - l * p.chunks);
    for (int64_t mb = blockIdx.y; mb < m_blocks; mb += gridDim.y) {
      const int64_t m0 = mb * kTileM;
      const int rows = static_cast<int>(p.m - m0 < kTileM ? p.m - m0 : kTileM);
      const char* a = p.a + 2 * (l * p.batch_a + m0 * p.lda);
      const char* b = p.b + 2 * (l * p.batch_b);
      const bool active = warp_m < rows;

      // Chunk c's float32 partial as a float32 D of a launch on that chunk alone holds it
      // (beta * 0 + alpha * acc: an accumulator of -0 is +0).
      auto fold = [&]() -> float4 {
        const int kt_begin = c * p.chunk_k_tiles;  // this chunk's K tiles: [kt_begin, kt_begin + nkt)
        const int nkt = (k_tiles - kt_begin < p.chunk_k_tiles ? k_tiles - kt_begin : p.chunk_k_tiles);

        // A thread's copies into a stage: fixed shared-memory offsets, source pointers that advance by
        // one K tile per refill (the refills come in K order), and zeros for chunks past M, N or K (the
        // ones TMA fills in). What a K tile costs in instructions is the kernel's time at M <= 16:
        // one warp per scheduler issues the copies and the MMA chain alike.
        constexpr int kALoads = T::kALoads, kBLoads = T::kBTileBytes / (16 * kThreads);
        const char* a_src[kALoads];
        int a_dst[kALoads], a_k[kALoads];
        bool a_live[kALoads], a_issued[kALoads];
#pragma unroll
        for (int j = 0; j < kALoads; ++j) {
          const int i = tid + j * kThreads, row = i >> 3, chunk = i & 7;
          a_src[j] = a + 2 * (row * p.lda + int64_t{kt_begin} * kTileK + 8 * chunk);
          a_dst[j] = k_major_offset(row, chunk);
          a_k[j] = 8 * chunk;
          a_live[j] = row < rows;
          // rows 8..15 are read only when the block has them; threads past A's chunks load none
          a_issued[j] = (row < 8 || rows > 8) && i < kATileBytes / 16;
        }
        const char* b_src[kBLoads];
        int b_dst[kBLoads], b_k[kBLoads];
        bool b_live[kBLoads];
#pragma unroll
        for (int j = 0; j < kBLoads; ++j) {
          const unsigned i = tid + j * kThreads;
          if constexpr (kBColumns) {  // row: n; chunk: 8 k
            const int row = static_cast<int>(i >> 3), chunk = static_cast<int>(i & 7);
            b_src[j] = b + 2 * ((n0 + row) * p.ldb + int64_t{kt_begin} * kTileK + 8 * chunk);
            b_dst[j] = kATileBytes + k_major_offset(row, chunk);
            b_k[j] = 8 * chunk;
            b_live[j] = n0 + row < p.n;
          } else {  // row: k; chunk: 8 n
            const int row = static_cast<int>(i / (TileN / 8)), chunk = static_cast<int>(i % (TileN / 8));
            b_src[j] = b + 2 * ((int64_t{kt_begin} * kTileK + row) * p.ldb + n0 + 8 * chunk);
            b_dst[j] = kATileBytes + T::b_offset(row, chunk);
            b_k[j] = row;
            b_live[j] = n0 + 8 * chunk < p.n;
          }
        }
        const int64_t b_step = kBColumns ? 2 * kTileK : 2 * kTileK * p.ldb;  // bytes per K tile
        int k_left = static_cast<int>(p.k) - kt_begin * kTileK;  // K past the next refill's first k
        auto load = [&](int s) {  // stage s <- the next K tile
          unsigned char* stage = smem + s * kStageBytes;
#pragma unroll
          for (int j = 0; j < kALoads; ++j) {
            const bool valid = a_live[j] && a_k[j] < k_left;
            if (a_issued[j]) cp_async16(stage + a_dst[j], valid ? a_src[j] : p.a, valid);
            a_src[j] += 2 * kTileK;
          }
#pragma unroll
          for (int j = 0; j < kBLoads; ++j) {
            const bool valid = b_live[j] && b_k[j] < k_left;
            cp_async16(stage + b_dst[j], valid ? b_src[j] : p.b, valid);
            b_src[j] += b_step;
          }
          k_left -= kTileK;
        };

        // All kStages stages in flight: iteration kt refills the stage of K tile kt, whose operands
        // every warp moved to registers in the iteration before (ahead of this iteration's barrier).
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
          if (s < nkt) load(s);
          cp_async_commit();
        }

        // One warp's operands of a K tile, per k16 step: B^T rows warp_n..+15 (the mma's A operand:
        // B's rows transposed, or B's columns as staged) and A^T, k by rows warp_m..+7 (its B operand).
        struct Operands {
          uint32_t bt[kTileK / 16][4];
          uint32_t at[kTileK / 16][2];
        };
        const int r8 = lane & 7, mat = lane >> 3;
        auto read = [&](Operands& o, int s, int ks) {  // k16 step ks of stage s
          const unsigned char* stage = smem + s * kStageBytes;
          if constexpr (kBColumns) {
            ldsm_x4(o.bt[ks],
                    stage + kATileBytes + k_major_offset(warp_n + 8 * (mat & 1) + r8, 2 * ks + (mat >> 1)));
          } else {
            ldsm_x4_trans(o.bt[ks], stage + kATileBytes +
                                        T::b_offset(16 * ks + 8 * (mat >> 1) + r8, warp_n / 8 + (mat & 1)));
          }
          ldsm_x2(o.at[ks], stage + k_major_offset(warp_m + r8, 2 * ks + (mat & 1)));
        };
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        auto step = [&](const Operands& o, int ks) {
          mma_m16n8k16<std::is_same_v<Element, cutlass::bfloat16_t>>(acc, o.bt[ks], o.at[ks][0], o.at[ks][1]);
        };
        // The accumulator's chain of k16 steps is the only serial path: the barrier, the next
        // refill and the next K tile's shared-memory reads are issued between its steps.
        int stage = 0;  // K tile kt's
        auto iteration = [&](int kt, const Operands& cur, Operands& next) {
          if (active) step(cur, 0);
          cp_async_wait<kStages - 2>();
          __syncthreads();  // K tile kt + 1 is in; every warp has read K tile kt's stage
          if (kt + kStages < nkt) load(stage);
          cp_async_commit();
          stage = stage + 1 == kStages ? 0 : stage + 1;
          if (active) {
            const bool more = kt + 1 < nkt;
            const int s = stage;
            step(cur, 1);
            if (more) read(next, s, 0), read(next, s, 1);
            step(cur, 2);
            if (more) read(next, s, 2), read(next, s, 3);
            step(cur, 3);
          }
        };
        Operands o0, o1;  // K tiles kt and kt + 1 (named, not indexed: registers, not local memory)
        cp_async_wait<kStages - 1>();
        __syncthreads();  // K tile 0 is in
        if (active && nkt > 0) {
#pragma unroll
          for (int ks = 0; ks < kTileK / 16; ++ks) read(o0, 0, ks);
        }
        int kt = 0;  // the chunk's K tiles, from its first
        for (; kt + 1 < nkt; kt += 2) {
          iteration(kt, o0, o1);
          iteration(kt + 1, o1, o0);
        }
        if (kt < nkt) iteration(kt, o0, o1);
        cp_async_wait<0>();
        return make_float4(fmaf(p.beta, 0.0f, p.alpha * acc[0]), fmaf(p.beta, 0.0f, p.alpha * acc[1]),
                           fmaf(p.beta, 0.0f, p.alpha * acc[2]), fmaf(p.beta, 0.0f, p.alpha * acc[3]));
      };
      const auto add = [](float4 x, float4 y) {
        return make_float4(detmath::add(x.x, y.x), detmath::add(x.y, y.y), detmath::add(x.z, y.z),
                           detmath::add(x.w, y.w));
      };
      // The tree's root rounded to D's type: lane's element i is D^T row n = warp_n + lane / 4 (+ 8
      // for i >= 2), column m = warp_m + 2 (lane % 4) + (i & 1).
      ElementD* d = static_cast<ElementD*>(p.d) + l * p.batch_d;
      auto store = [&](float4 r) {
        const float root[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int64_t n = n0 + warp_n + (lane >> 2) + 8 * (i >> 1);
          const int mi = warp_m + 2 * (lane & 3) + (i & 1);
          if (mi < rows && n < p.n) store_root(d + (m0 + mi) * p.ldd + n, root[i]);
        }
      };
      const float4 r = fold();
      if (p.chunks == 1) {
        if (active) store(r);
      } else {
        const int64_t tile = (l * m_blocks + mb) * p.n_tiles + blockIdx.x;
        const int64_t chunk_stride = m_blocks * p.n_tiles * kThreads;  // float4s from chunk c to c + 1
        float4* part = reinterpret_cast<float4*>(p.partials) +
                       ((l * p.chunks * m_blocks + mb) * p.n_tiles + blockIdx.x) * kThreads + tid;
        __stcg(part + c * chunk_stride, r);
        __threadfence();  // the partial is visible before this CTA's arrival is counted
        __syncthreads();
        __shared__ int combine;
        if (tid == 0) combine = atomicAdd(p.counters + tile, 1) == p.chunks - 1;
        __syncthreads();
        if (combine) {
          __threadfence();  // every other chunk's partial, counted before ours, is visible
          if (active)
            store(detmath::tree_fold<float4>(
                p.chunks, [&](int64_t i) { return __ldcg(part + i * chunk_stride); }, add));
        }
      }
      __syncthreads();  // the next work item's prologue overwrites the stages
    }
  }
}

// The kernel's arguments and grid for a problem (one CTA per TileN columns, per 16 rows, per batch and
// per chunk; the last two factors capped at the grid's limit and walked by the CTAs).
template <int TileN>
Params make_params(const GemmArgs& g) {
  Params p;
  p.m = g.m;
  p.n = g.n;
  p.k = g.k;
  p.l = g.l;
  p.m_blocks = (g.m + kTileM - 1) / kTileM;
  p.k_tiles = static_cast<int>((g.k + kTileK - 1) / kTileK);
  p.a = static_cast<const char*>(g.a);
  p.lda = g.lda;
  p.batch_a = g.batch_a;
  p.b = static_cast<const char*>(g.b);
  p.ldb = g.ldb;
  p.batch_b = g.batch_b;
  p.d = g.d;
  p.ldd = g.ldd;
  p.batch_d = g.batch_d;
  p.alpha = 1.0f;
  p.beta = 0.0f;
  p.n_tiles = (g.n + TileN - 1) / TileN;
  const int64_t chunk_k_tiles = g.chunk / kTileK;
  p.chunks = g.chunk > 0 && p.k_tiles > chunk_k_tiles
                 ? static_cast<int>((p.k_tiles + chunk_k_tiles - 1) / chunk_k_tiles)
                 : 1;
  p.chunk_k_tiles = p.chunks > 1 ? static_cast<int>(chunk_k_tiles) : p.k_tiles;
  p.partials = nullptr;
  p.counters = nullptr;
  return p;
}
inline dim3 grid_of(const Params& p) {
  const int64_t units = p.l * p.chunks;
  return dim3(static_cast<unsigned>(p.n_tiles), static_cast<unsigned>(p.m_blocks < 65535 ? p.m_blocks : 65535),
              static_cast<unsigned>(units < 65535 ? units : 65535));
}

// The launcher of the Hopper forward and dA sets' 16x32 and 16x16 tiles (its generated unit calls it as
// the sm90 ones call sm90::launch): A [M, K] row-major, B stored [K, N] (forward) or [N, K] (dA), no
// source C.
template <class Element, class LayoutA, class LayoutB, class ElementC, class ElementD, int TileM, int TileN>
Status launch(const GemmArgs& g, cudaStream_t stream) {
  constexpr bool kBColumns = std::is_same_v<LayoutB, cutlass::layout::ColumnMajor>;
  static_assert(is_narrow_tile(TileM, TileN) && std::is_same_v<LayoutA, cutlass::layout::RowMajor> &&
                    (kBColumns || std::is_same_v<LayoutB, cutlass::layout::RowMajor>) &&
                    std::is_void_v<ElementC> &&
                    (std::is_same_v<Element, cutlass::bfloat16_t> || std::is_same_v<Element, cutlass::half_t>),
                "the narrow tiles are 16x32 and 16x16 and serve bfloat16/float16 products of a row-major A and a "
                "B stored [K, N] or [N, K], no source C");
  using T = Tile<TileN>;
  const auto misaligned = [](const void* ptr, int64_t stride) {
    return reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || stride % 8 != 0;
  };
  if (misaligned(g.a, g.lda) || misaligned(g.b, g.ldb) || g.batch_a % 8 != 0 || g.batch_b % 8 != 0) {
    return "the narrow (16-row mma.sync) kernel cannot run this problem: cp.async needs every operand's "
           "contiguous dimension to be a multiple of 8 elements (bfloat16/float16) and 16-byte aligned pointers";
  }
  constexpr int64_t kMax = 0x7fffffff;
  if (g.m > kMax || g.n > kMax || g.k > kMax || g.l > kMax) return "a dimension is larger than 2^31 - 1";
  const auto kernel = narrow_gemm_kernel<Element, ElementD, TileN, kStages, kBColumns>;
  static std::atomic<uint64_t> smem_set{0};  // the dynamic shared-memory limit, once per device
  const uint64_t bit = uint64_t{1} << (g.device & 63);
  if (!(smem_set.load(std::memory_order_acquire) & bit)) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes<TileN>);
    if (e != cudaSuccess) return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
    smem_set.fetch_or(bit, std::memory_order_acq_rel);
  }
  Params p = make_params<TileN>(g);
  if (p.chunks > 1 && g.chunk % kTileK != 0) return "the chunk must be a multiple of the K tile (64)";
  if (p.chunks > 1) {
    // Workspace: the partials, then the counters (jaxdet/_src/matmul/matmul.py's gemm_workspace_bytes
    // bounds both: tiles padded to 128 x 256 and a counter per 16 x 16 tile per chunk).
    const int64_t floats = p.l * p.chunks * p.m_blocks * p.n_tiles * T::kThreads * 4;
    const int64_t counters = p.l * p.m_blocks * p.n_tiles;
    const size_t need =
        static_cast<size_t>(floats) * sizeof(float) + static_cast<size_t>(counters) * sizeof(int32_t);
    if (g.chunk_workspace == nullptr || g.chunk_workspace_bytes < need ||
        reinterpret_cast<uintptr_t>(g.chunk_workspace) % 16 != 0) {
      return "internal error: the chunk workspace is smaller than the narrow kernel needs";
    }
    p.partials = static_cast<float*>(g.chunk_workspace);
    p.counters = reinterpret_cast<int32_t*>(p.partials + floats);
    const cudaError_t e = cudaMemsetAsync(p.counters, 0, counters * sizeof(int32_t), stream);
    if (e != cudaSuccess) return std::string("cudaMemsetAsync: ") + cudaGetErrorString(e);
  }
  kernel<<<grid_of(p), T::kThreads, kSmemBytes<TileN>, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("launch: ") + cudaGetErrorString(e);
  return {};
}

}  // namespace narrow
}  // namespace gemm
}  // namespace jaxdet
