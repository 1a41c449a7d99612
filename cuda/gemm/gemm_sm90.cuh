// Hopper (sm_90a) GEMM launchers: CUTLASS 3.x collective builder, TMA warp-specialized cooperative
// kernel, persistent data-parallel tile scheduler. Included by the generated translation units of
// the sm90 family (cuda/gemm/kernels.cmake), which are compiled for sm_90a only.
//
// Batch invariance: the K-tile sequence, the wgmma K depth, the mainloop and the scheduler are
// compile-time constants shared by every launcher of a kernel set (the tiles differ only in the
// output tile's rows and columns). One CTA owns a whole output tile and walks K from 0 upwards in
// tiles of 64; a row's bits depend only on that row of A and on B. TMA zero-fills the
// out-of-bounds part of edge tiles (rows beyond M, columns beyond N, K beyond the last full tile),
// and every tile sees the same zeros in the same K steps.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cutlass/kernel_hardware_info.h"
#include "gemm_args.h"
#include "gemm_sm90_chunks.cuh"

namespace jaxdet {
namespace gemm {
namespace sm90 {

// What every Hopper kernel shares (forward nn, dA nt, weight gradient tn; bf16 and f16; every tile
// of a kernel set): the K tile of 64, wgmma instructions of K depth 16 with float32 accumulators
// (the collective mainloop MainloopSm90TmaGmmaWarpSpecialized: the first wgmma of a tile's first K
// tile starts the accumulator, every later one adds, K tiles in ascending order), cluster 1x1x1,
// the data-parallel persistent scheduler and the LinearCombination epilogue. A tile of 128 rows
// runs the cooperative schedule (two consumer warpgroups, each wgmma m64nNk16 on its 64 rows); a
// tile of 64 rows the ping-pong schedule (each consumer warpgroup owns a whole 64-row tile, the two
// alternate). Either way each output element is one accumulator fed by the same wgmma K steps in
// the same order, so the tile decides only which CTA computes an element, never its bits.
constexpr int kTileK = 64;

// ElementC = void: D = acc (no source read). ElementC = float: D = acc + beta * C. LayoutD_ is
// column-major only for the swapped operands of the few-row tile (launch, below).
template <class ElementAB, class LayoutA, class LayoutB, class ElementC, class ElementD, int TileM, int TileN,
          class LayoutD_ = cutlass::layout::RowMajor, int ClusterM = 1, int ClusterN = 1>
struct Config {
  static_assert(TileM == 64 || TileM == 128, "Hopper tiles have 64 (ping-pong) or 128 (cooperative) rows");
  static constexpr bool kCooperative = TileM == 128;
  using ClusterShape = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
  using TileShape = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Int<kTileK>>;
  using MainloopSchedule = std::conditional_t<kCooperative, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                              cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using EpilogueSchedule = std::conditional_t<kCooperative, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                              cutlass::epilogue::TmaWarpSpecialized>;
  using LayoutD = LayoutD_;
  // Raster order of the persistent scheduler (which CTA takes which tile, never what a tile
  // computes: identical result hashes for every order, tools/gemm_schedule_bits.py). The
  // cooperative (128-row) forward and dA kernels raster along N, its weight gradient takes CUTLASS's heuristic
  // (the faster orders on an H100, benchmarks/RESULTS.md). The narrow tiles serve few rows: along
  // M, the CTAs of one column of tiles run together and read that slice of B from memory once.
  static constexpr auto kRasterOrder = !kCooperative ? cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM
                                       : std::is_same_v<LayoutA, cutlass::layout::RowMajor>
                                           ? cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN
                                           : cutlass::gemm::kernel::detail::RasterOrderOptions::Heuristic;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using ElementSource = std::conditional_t<std::is_void_v<ElementC>, ElementD, ElementC>;
  static constexpr int kAlignC = 16 / sizeof(ElementSource);
  using Fusion = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementSource, float>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD, kAlignC, ElementD, LayoutD,
      kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA, kAlignAB, ElementAB, LayoutB,
      kAlignAB, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  // The cooperative (128-row) tiles take jaxdet's chunk scheduler (gemm_sm90_chunks.cuh: the chunk
  // rule in one launch, data-parallel with one chunk); the ping-pong tiles the data-parallel
  // persistent scheduler (a chunked call with them runs chunk by chunk, matmul_cuda.cu). Never
  // CUTLASS's stream-K or split-K, whose reductions follow the SM count and the problem's shape.
  using TileSchedulerTag = std::conditional_t<kCooperative, ChunkedScheduler, cutlass::gemm::PersistentScheduler>;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue, TileSchedulerTag>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static_assert(std::is_same_v<typename Kernel::TileScheduler,
                               std::conditional_t<kCooperative, ChunkedTileScheduler,
                                                  cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90>>,
                "jaxdet GEMM: the chunk scheduler (cooperative tiles) or the data-parallel one (ping-pong)");
  static_assert(!std::is_same_v<typename Kernel::TileSchedulerTag, cutlass::gemm::StreamKScheduler>,
                "stream-K breaks batch invariance");
  // What every tile of a kernel set must share (docs/matmul_cuda.md, "M buckets"): the mainloop
  // (and with it the order of K tiles and of wgmma steps), the K tile, the instruction's K depth,
  // float32 accumulators.
  static_assert(std::is_same_v<typename Mainloop::DispatchPolicy,
                               cutlass::gemm::MainloopSm90TmaGmmaWarpSpecialized<Mainloop::DispatchPolicy::Stages,
                                                                                 ClusterShape, MainloopSchedule>>,
                "every Hopper tile must run the same TMA + wgmma (ss) mainloop");
  static_assert(cute::size<2>(typename Mainloop::TileShape{}) == kTileK, "every Hopper tile has K tile 64");
  static_assert(cute::size<2>(typename Mainloop::TiledMma::AtomShape_MNK{}) == 16,
                "every Hopper tile issues wgmma of K depth 16");
  static_assert(cute::size<0>(typename Mainloop::TiledMma::AtomShape_MNK{}) == 64 &&
                    cute::size<1>(typename Mainloop::TiledMma::AtomShape_MNK{}) == TileN,
                "one wgmma m64nNk16 covers a warpgroup's 64 rows and the tile's N columns");
  static_assert(std::is_same_v<typename Mainloop::TiledMma::ValTypeC, float>, "float32 accumulators");
};

// Sets the strides of a cute stride type from (s0, s1, s2), skipping its static (unit) modes.
template <class Stride>
Stride make_stride3(int64_t s0, int64_t s1, int64_t s2) {
  Stride s{};
  if constexpr (!cute::is_static_v<std::decay_t<decltype(cute::get<0>(s))>>) cute::get<0>(s) = s0;
  if constexpr (!cute::is_static_v<std::decay_t<decltype(cute::get<1>(s))>>) cute::get<1>(s) = s1;
  cute::get<2>(s) = s2;
  return s;
}

// The persistent scheduler's tile swizzle (groups of 8 tiles along the raster for L2 reuse). It
// only decides which CTA computes which output tile, never what a tile computes (verified on the
// GPU: identical output hashes for swizzle 1 and 8, cluster 1x1 and 2x1).
constexpr int kSwizzle = 8;

inline bool fits_int(int64_t v) { return v >= 0 && v <= std::numeric_limits<int>::max(); }

template <class Cfg>
Status run(const GemmArgs& g, cudaStream_t stream) {
  using Kernel = typename Cfg::Kernel;
  using Gemm = typename Cfg::Gemm;
  using ElementAB = typename Kernel::ElementA;
  using ElementD = typename Kernel::ElementD;
  using StrideA = typename Kernel::StrideA;
  using StrideB = typename Kernel::StrideB;
  using StrideC = typename Kernel::StrideC;
  using StrideD = typename Kernel::StrideD;

  if (!fits_int(g.m) || !fits_int(g.n) || !fits_int(g.k) || !fits_int(g.l)) {
    return "a dimension is larger than 2^31 - 1";
  }
  // Each stride type has one static unit mode (the contiguous one); make_stride3 skips it, so the
  // leading dimension lands in the other mode whatever the layout.
  const StrideA sa = make_stride3<StrideA>(g.lda, g.lda, g.batch_a);
  const StrideB sb = make_stride3<StrideB>(g.ldb, g.ldb, g.batch_b);
  const StrideC sc = make_stride3<StrideC>(g.ldc, g.ldc, g.batch_c);
  const StrideD sd = make_stride3<StrideD>(g.ldd, g.ldd, g.batch_d);

  cutlass::KernelHardwareInfo hw;
  hw.device_id = g.device;
  hw.sm_count = g.sm_count;

  typename Kernel::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k), static_cast<int>(g.l)},
      {static_cast<const ElementAB*>(g.a), sa, static_cast<const ElementAB*>(g.b), sb},
      {{}, static_cast<const typename Kernel::ElementC*>(g.c), sc, static_cast<ElementD*>(g.d), sd},
      hw};
  args.scheduler.max_swizzle_size = kSwizzle;  // which CTA takes which tile: not the numerics
  args.scheduler.raster_order = Cfg::kRasterOrder;                 // the same
  const int64_t k_tiles = (g.k + kTileK - 1) / kTileK;
  if (g.chunk > 0 && k_tiles * kTileK > g.chunk) {
    if constexpr (!Cfg::kCooperative) {
      return "internal error: a chunked K reached a kernel without the chunk scheduler";
    } else {
      if (g.chunk % kTileK != 0) return "the chunk must be a multiple of the K tile (64)";
      const int chunk_k_tiles = static_cast<int>(g.chunk / kTileK);
      const int32_t chunks = ChunkedTileScheduler::chunk_count(k_tiles, chunk_k_tiles);
      const int64_t tile_m = cute::size<0>(typename Kernel::TileShape{});
      const int64_t tile_n = cute::size<1>(typename Kernel::TileShape{});
      const int64_t tiles = g.l * ((g.m + tile_m - 1) / tile_m) * ((g.n + tile_n - 1) / tile_n);
      const int64_t tile_floats = tile_m * tile_n;
      // Split-K when the tiles alone leave SMs idle; otherwise each CTA walks its tiles' chunks.
      const bool split = tiles < g.sm_count;
      const int64_t grid = std::min<int64_t>(tiles, g.sm_count);
      // The pending subtrees of each tile (split) or each CTA (walking), and one flag per tile.
      const int64_t floats = (split ? tiles : grid) * ChunkedTileScheduler::stack_depth(chunks) * tile_floats;
      const int64_t flags = split ? tiles : 0;
      const size_t need =
          static_cast<size_t>(floats) * sizeof(float) + static_cast<size_t>(flags) * sizeof(int32_t);
      if (g.chunk_workspace == nullptr || g.chunk_workspace_bytes < need) {
        return "internal error: the chunk workspace is smaller than the kernel needs";
      }
      args.scheduler.max_swizzle_size = 1;  // tiles exactly as many as the output has (the workspace's)
      args.scheduler.chunk_k_tiles = chunk_k_tiles;
      args.scheduler.split = split;
      args.scheduler.partials = static_cast<float*>(g.chunk_workspace);
      args.scheduler.flags = reinterpret_cast<int32_t*>(static_cast<float*>(g.chunk_workspace) + floats);
      if (split) {
        const cudaError_t e = cudaMemsetAsync(args.scheduler.flags, 0, flags * sizeof(int32_t), stream);
        if (e != cudaSuccess) return std::string("cudaMemsetAsync: ") + cudaGetErrorString(e);
      }
    }
  }
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = g.beta;

  if (!Kernel::can_implement(args)) {
    return "CUTLASS cannot run this problem: TMA needs every operand's contiguous dimension to be a "
           "multiple of 16 bytes (8 elements for bfloat16/float16) and 16-byte aligned pointers";
  }
  if (Kernel::get_workspace_size(args) != 0) {
    return "internal error: the data-parallel scheduler asked for a workspace";
  }

  // Raise the dynamic shared-memory limit once per device (cudaFuncSetAttribute is per device).
  static std::atomic<uint64_t> smem_set{0};
  const uint64_t bit = uint64_t{1} << (g.device & 63);
  if (!(smem_set.load(std::memory_order_acquire) & bit)) {
    const int smem = Kernel::SharedStorageSize;
    if (smem >= (48 << 10)) {
      const cudaError_t e =
          cudaFuncSetAttribute(cutlass::device_kernel<Kernel>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (e != cudaSuccess) {
        return std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(e);
      }
    }
    smem_set.fetch_or(bit, std::memory_order_acq_rel);
  }

  typename Kernel::Params params = Kernel::to_underlying_arguments(args, nullptr);
  const cutlass::Status st = Gemm::run(params, stream);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS launch failed: ") + cutlassGetStatusString(st);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("launch: ") + cudaGetErrorString(e);
  return {};
}

template <class Layout>
using Transposed = std::conditional_t<std::is_same_v<Layout, cutlass::layout::RowMajor>,
                                      cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

// The few-row tile (16 rows of D by 64 columns) runs D^T = B^T A^T: B fills the 64 rows of the
// wgmma (m64n16k16) and A its 16 columns, so a CTA stages 16 rows of A per K tile instead of 64.
// Each element of D is still one float32 accumulator fed by the same products (a_mk * b_kn) in the
// same k16 steps, K ascending; tests/test_gemm_buckets.py proves it gives the bits of every other
// tile of its set.
inline GemmArgs swapped_operands(const GemmArgs& g) {
  GemmArgs t = g;
  t.m = g.n;
  t.n = g.m;
  t.a = g.b;
  t.lda = g.ldb;
  t.batch_a = g.batch_b;
  t.b = g.a;
  t.ldb = g.lda;
  t.batch_b = g.batch_a;
  return t;  // D^T is D read column-major: the same pointer, leading dimension and batch stride
}

// The launcher of one generated unit (cuda/gemm/kernels.cmake).
template <class ElementAB, class LayoutA, class LayoutB, class ElementC, class ElementD, int TileM, int TileN>
Status launch(const GemmArgs& args, cudaStream_t stream) {
  if constexpr (TileM == 16) {
    static_assert(TileN == 64 && std::is_void_v<ElementC>, "the swapped few-row tile is 16x64, with no source C");
    return run<Config<ElementAB, Transposed<LayoutB>, Transposed<LayoutA>, ElementC, ElementD, 64, 16,
                      cutlass::layout::ColumnMajor>>(swapped_operands(args), stream);
  } else {
    return run<Config<ElementAB, LayoutA, LayoutB, ElementC, ElementD, TileM, TileN>>(args, stream);
  }
}

}  // namespace sm90
}  // namespace gemm
}  // namespace jaxdet
