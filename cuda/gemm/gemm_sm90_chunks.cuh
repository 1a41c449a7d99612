// The tile scheduler of the Hopper cooperative (128-row) GEMM kernels: the chunk rule of
// docs/matmul.md inside one launch. K is cut into chunks of `chunk_k_tiles` K tiles; each chunk's
// partial starts from zero in the wgmma accumulators (the collective mainloop restarts its
// accumulators at each work unit) and the partials meet by the canonical tree (balanced, lower
// index first, padded to a power of two with absent leaves), in float32, before the epilogue casts
// once. A work unit is one (output tile, chunk). Two ways to hand units to CTAs, the same
// arithmetic (so the same bits):
//   - walk (many tiles): a CTA takes a tile and walks its chunks in order, keeping the tree's
//     pending subtrees in its own slice of the workspace (the binary counter: at most
//     log2(chunks) + 1 live). Each thread reads back only what it wrote, so no synchronisation.
//   - split (fewer tiles than SMs: split-K): units are dealt chunk-major, so every chunk of every
//     tile runs at once; after its mainloop, the unit of chunk c waits until the tile's flag
//     counts c chunks, merges its partial into the tile's pending subtrees, and raises the flag
//     (merges in chunk order, mainloops side by side); the final chunk's unit ends with the root
//     and runs the epilogue. A CTA only ever waits for units of lower index of its tile, whose
//     chain ends at chunk 0, which never waits, and a persistent grid holds at most one CTA per
//     SM, so all run: no deadlock. No atomics touch the data; flags are plain release stores and
//     acquire loads.
// With one chunk (K <= chunk, or no chunk given) it is the data-parallel persistent scheduler.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cutlass.h"
#include "cutlass/gemm/kernel/sm90_tile_scheduler.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace jaxdet {
namespace gemm {
namespace sm90 {

// The pending partials' L2 policy: a stored subtree is read once, by the unit that merges it a
// whole mainloop later, while the operands stream through L2; kept with evict_last (and dropped
// with evict_first once read), the merge reads L2 instead of DRAM. The 64-bit policies are the
// ones cute::TMA::CacheHintSm90 passes to TMA. Hints only: no value depends on them.
constexpr uint64_t kL2EvictFirst = 0x12F0000000000000ull;
constexpr uint64_t kL2EvictLast = 0x14F0000000000000ull;

CUTLASS_DEVICE float4 load_pending(const float4* p) {
  float4 v;
  asm volatile("ld.global.cg.L2::cache_hint.v4.f32 {%0, %1, %2, %3}, [%4], %5;"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p), "l"(kL2EvictFirst)
               : "memory");
  return v;
}

CUTLASS_DEVICE void store_pending(float4* p, float4 v) {
  asm volatile("st.global.cg.L2::cache_hint.v4.f32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(p), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w), "l"(kL2EvictLast)
               : "memory");
}

// The tag that selects ChunkedTileScheduler in CUTLASS's GemmUniversal.
struct ChunkedScheduler {};

struct ChunkedSchedulerArguments {
  int max_swizzle_size = 1;
  cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::RasterOrderOptions raster_order =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90::RasterOrderOptions::Heuristic;
  int chunk_k_tiles = 0;  // K tiles per chunk; 0: one chunk
  bool split = false;
  float* partials = nullptr;
  int32_t* flags = nullptr;  // one per tile, zero before the launch (split only)
};

class ChunkedTileScheduler {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90;

 public:
  using RasterOrder = Base::RasterOrder;
  using RasterOrderOptions = Base::RasterOrderOptions;
  static constexpr bool IsDynamicPersistent = false;
  using Pipeline = Base::Pipeline;
  using PipelineStorage = Base::PipelineStorage;
  using ThrottlePipeline = Base::ThrottlePipeline;
  using ThrottlePipelineStorage = Base::ThrottlePipelineStorage;
  using CLCResponse = Base::CLCResponse;
  using SharedStorage = Base::SharedStorage;

  struct WorkTileInfo {
    int32_t M_idx = 0;
    int32_t N_idx = 0;
    int32_t L_idx = 0;
    bool is_valid_tile = false;
    int32_t chunk = 0;
    int32_t tile = 0;  // the output tile's linear index
    int32_t cta = 0;   // the CTA's linear index (its slice of the workspace when walking)
    uint32_t k_tile_start = 0;
    uint32_t k_tile_count = 0;

    CUTLASS_HOST_DEVICE bool is_valid() const { return is_valid_tile; }
    CUTLASS_HOST_DEVICE static WorkTileInfo invalid_work_tile() { return {-1, -1, -1, false}; }
    CUTLASS_HOST_DEVICE bool is_final_split(uint32_t) const { return true; }
    CUTLASS_HOST_DEVICE int32_t reduction_subtile_idx() const { return -1; }
  };

  using Arguments = ChunkedSchedulerArguments;

  struct Params : cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params {
    int32_t chunks = 1;
    int32_t chunk_k_tiles = 0;
    int32_t k_tiles = 0;
    int32_t stack_depth = 0;
    bool split = false;
    uint64_t tiles = 0;
    float* partials = nullptr;
    int32_t* flags = nullptr;
  };

  // K tiles and chunks of a problem (host and device).
  static int32_t chunk_count(int64_t k_tiles, int chunk_k_tiles) {
    return chunk_k_tiles <= 0 || k_tiles <= chunk_k_tiles
               ? 1
               : static_cast<int32_t>((k_tiles + chunk_k_tiles - 1) / chunk_k_tiles);
  }
  // The most subtrees a walk keeps pending: after leaf c it holds popcount(c + 1) of them, and the
  // last leaf is never stored, so at most the bit length of chunks - 1.
  static int32_t stack_depth(int32_t chunks) {
    int32_t bits = 0;
    while ((int64_t{1} << bits) <= chunks - 1) ++bits;
    return bits;
  }

  template <class ProblemShapeMNKL, class TileShape, class ClusterShape>
  static Params to_underlying_arguments(ProblemShapeMNKL problem_shape_mnkl, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& args, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1, uint32_t ktile_start_alignment = 1u) {
    Params p;
    static_cast<cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params&>(p) =
        Base::to_underlying_arguments(problem_shape_mnkl, tile_shape, cluster_shape, hw_info,
                                      Base::Arguments{args.max_swizzle_size, args.raster_order}, workspace,
                                      epilogue_subtile, ktile_start_alignment);
    const int64_t k = cute::get<2>(problem_shape_mnkl);
    p.k_tiles = static_cast<int32_t>((k + cute::get<2>(tile_shape) - 1) / cute::get<2>(tile_shape));
    p.chunks = chunk_count(p.k_tiles, args.chunk_k_tiles);
    p.chunk_k_tiles = p.chunks > 1 ? args.chunk_k_tiles : p.k_tiles;
    p.stack_depth = stack_depth(p.chunks);
    p.split = p.chunks > 1 && args.split;
    p.tiles = p.blocks_per_problem_;
    p.partials = args.partials;
    p.flags = args.flags;
    return p;
  }

  static bool can_implement(Arguments const& args) {
    return args.max_swizzle_size >= 0 && args.chunk_k_tiles >= 0;
  }

  template <class ProblemShape, class ElementAccumulator>
  static size_t get_workspace_size(Arguments const&, ProblemShape, cutlass::KernelHardwareInfo const&, uint32_t,
                                   const uint32_t = 1, uint32_t = 1) {
    return 0;  // the caller passes the partials and flags (their size: chunk_workspace_floats)
  }

  template <class ProblemShape, class ElementAccumulator>
  static cutlass::Status initialize_workspace(Arguments const&, void*, cudaStream_t, ProblemShape,
                                              cutlass::KernelHardwareInfo const&, uint32_t, const uint32_t = 1,
                                              uint32_t = 1, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  // One CTA per SM at most (all resident: what split's waiting needs), and no more than units.
  template <class ProblemShapeMNKL, class BlockShape, class ClusterShape>
  static dim3 get_grid_shape(Params const& params, ProblemShapeMNKL, BlockShape, ClusterShape,
                             cutlass::KernelHardwareInfo hw_info, Arguments = Arguments{}, bool = true) {
    const uint64_t units = params.split ? params.tiles * params.chunks : params.tiles;
    const uint64_t sms = hw_info.sm_count > 0 ? static_cast<uint64_t>(hw_info.sm_count) : 1;
    return dim3(static_cast<unsigned>(units < sms ? units : sms), 1, 1);
  }

  CUTLASS_DEVICE explicit ChunkedTileScheduler(Params const& params) : params_(params), base_(params) {
#if defined(__CUDA_ARCH__)
    cta_ = blockIdx.x;
    grid_ = gridDim.x;
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return work(step_);
  }
  CUTLASS_DEVICE WorkTileInfo get_current_work() const { return work(step_); }
  CUTLASS_DEVICE void advance_to_next_work(uint32_t advance_count = 1) { step_ += advance_count; }
  CUTLASS_DEVICE bool is_last_tile(WorkTileInfo&, uint32_t advance_count = 1) const {
    return !work(step_ + advance_count).is_valid();
  }
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo) {
    ++step_;
    return cute::make_tuple(work(step_), true);
  }
  template <class TileSchedulerPipeline, class TileSchedulerPipelineState>
  CUTLASS_DEVICE auto fetch_next_work(WorkTileInfo info, TileSchedulerPipeline&, TileSchedulerPipelineState) {
    return fetch_next_work(info);
  }

  CUTLASS_HOST_DEVICE static bool valid_warpgroup_in_work_tile(WorkTileInfo const&) { return true; }
  CUTLASS_HOST_DEVICE static bool requires_separate_reduction(Params const&) { return false; }
  // Only the final chunk's unit writes the output tile.
  CUTLASS_HOST_DEVICE static bool compute_epilogue(WorkTileInfo const& info, Params const& params) {
    return info.chunk == params.chunks - 1;
  }

  template <class ProblemShape, class TileShape>
  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_count(WorkTileInfo const& info, ProblemShape, TileShape) {
    return info.k_tile_count;
  }
  CUTLASS_HOST_DEVICE static uint32_t get_work_k_tile_start(WorkTileInfo const& info) { return info.k_tile_start; }

  // After a unit's mainloop: its partial joins the chunk tree, kept as the binary counter's pending
  // subtrees (left + right, as each pair completes; after the last leaf they join right to left).
  // Walking, the stack is the CTA's own and each thread reads back only what it wrote. Split, the
  // stack is the tile's: unit c waits until the tile's flag says c chunks are in, merges, then
  // raises it to c + 1, so the merges run in chunk order while the mainloops overlap. On return,
  // the final chunk's accumulators hold the tree's root (the other units skip the epilogue).
  // Element i of thread tid lives at float4 (i / 4) * threads + tid: whole-fragment loads and
  // stores of 16 bytes, coalesced, all independent (one memory latency per merge, not one per
  // element).
  template <class FrgTensorC>
  CUTLASS_DEVICE static void fixup(Params const& params, WorkTileInfo const& info, FrgTensorC& acc,
                                   uint32_t num_mma_warp_groups, uint32_t warp_group_idx) {
    if (params.chunks <= 1) return;
    // The mainloop's last wgmma has retired (mma_tail waited); the fence ties the accumulators'
    // registers to that point, so no access below can be scheduled among the wgmma stages.
    cute::warpgroup_wait<0>();
    cute::warpgroup_fence_operand(acc);
    constexpr int kElems = decltype(cute::size(acc))::value;
    static_assert(kElems % 4 == 0, "fragments move as float4");
    constexpr int kGroups = kElems / 4;
    const int threads = static_cast<int>(num_mma_warp_groups) * cutlass::NumThreadsPerWarpGroup;
    const int tid = static_cast<int>(warp_group_idx) * cutlass::NumThreadsPerWarpGroup +
                    static_cast<int>(threadIdx.x % cutlass::NumThreadsPerWarpGroup);
    const int64_t tile_floats = int64_t{kElems} * threads;
    const int c = info.chunk;
    const bool last = c == params.chunks - 1;
    const int64_t owner = params.split ? int64_t{info.tile} : int64_t{info.cta};
    float* stack = params.partials + owner * params.stack_depth * tile_floats;
    int32_t* flag = params.flags + info.tile;
    if (params.split) {
      if (tid == 0) {
        int32_t done = 0;
        do {
          asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(done) : "l"(flag) : "memory");
        } while (done != c);
      }
      cutlass::arch::NamedBarrier::sync(threads, cutlass::arch::ReservedNamedBarriers::StreamkBarrier0);
    }
    int depth = __popc(c);                                // subtrees pending before this chunk: the bits of c
    const int merges = last ? depth : __ffs(~c) - 1;      // the last joins them all; others their trailing ones
    for (int q = 0; q < merges; ++q) {
      --depth;
      const float4* slot = reinterpret_cast<const float4*>(stack + depth * tile_floats) + tid;
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kGroups; ++g) {
        const float4 x = load_pending(slot + g * threads);
        acc(4 * g + 0) = __fadd_rn(x.x, acc(4 * g + 0));
        acc(4 * g + 1) = __fadd_rn(x.y, acc(4 * g + 1));
        acc(4 * g + 2) = __fadd_rn(x.z, acc(4 * g + 2));
        acc(4 * g + 3) = __fadd_rn(x.w, acc(4 * g + 3));
      }
    }
    if (!last) {
      float4* slot = reinterpret_cast<float4*>(stack + depth * tile_floats) + tid;
      CUTLASS_PRAGMA_UNROLL
      for (int g = 0; g < kGroups; ++g) {
        store_pending(slot + g * threads, make_float4(acc(4 * g), acc(4 * g + 1), acc(4 * g + 2), acc(4 * g + 3)));
      }
      if (params.split) {
        __threadfence();
        cutlass::arch::NamedBarrier::sync(threads, cutlass::arch::ReservedNamedBarriers::StreamkBarrier0);
        if (tid == 0) asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(flag), "r"(c + 1) : "memory");
      }
    }
    cute::warpgroup_fence_operand(acc);
  }

 private:
  // The unit of this CTA's step `s`.
  CUTLASS_DEVICE WorkTileInfo work(uint64_t s) const {
    const uint64_t chunks = static_cast<uint64_t>(params_.chunks);
    uint64_t tile, chunk;
    if (params_.split) {  // chunk-major over all CTAs
      const uint64_t unit = cta_ + s * grid_;
      chunk = unit / params_.tiles;
      tile = unit - chunk * params_.tiles;
      if (chunk >= chunks) return WorkTileInfo::invalid_work_tile();
    } else {  // each tile's chunks in order on one CTA
      chunk = s % chunks;
      tile = cta_ + (s / chunks) * grid_;
      if (tile >= params_.tiles) return WorkTileInfo::invalid_work_tile();
    }
    const auto mnl = base_.get_current_work_for_linear_idx(tile);
    WorkTileInfo info;
    info.M_idx = mnl.M_idx;
    info.N_idx = mnl.N_idx;
    info.L_idx = mnl.L_idx;
    info.is_valid_tile = true;
    info.chunk = static_cast<int32_t>(chunk);
    info.tile = static_cast<int32_t>(tile);
    info.cta = static_cast<int32_t>(cta_);
    info.k_tile_start = static_cast<uint32_t>(chunk * params_.chunk_k_tiles);
    const uint32_t left = static_cast<uint32_t>(params_.k_tiles) - info.k_tile_start;
    info.k_tile_count = left < static_cast<uint32_t>(params_.chunk_k_tiles) ? left : params_.chunk_k_tiles;
    return info;
  }

  Params params_;
  Base base_;
  uint64_t cta_ = 0;
  uint64_t grid_ = 1;
  uint64_t step_ = 0;
};

}  // namespace sm90
}  // namespace gemm
}  // namespace jaxdet

namespace cutlass::gemm::kernel::detail {
template <class ArchTag, class TileShape, class ClusterShape, uint32_t SchedulerPipelineStageCount>
struct TileSchedulerSelector<jaxdet::gemm::sm90::ChunkedScheduler, ArchTag, TileShape, ClusterShape,
                             SchedulerPipelineStageCount> {
  using Scheduler = jaxdet::gemm::sm90::ChunkedTileScheduler;
};
}  // namespace cutlass::gemm::kernel::detail
