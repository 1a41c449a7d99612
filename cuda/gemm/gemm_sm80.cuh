// sm_80+ GEMM launchers (CUTLASS 2.x GemmUniversal, batched mode): the bf16/f16 tensor-op kernels
// (mma.sync m16n8k16, multistage cp.async) and the true-float32 SIMT kernel (FFMA; never TF32).
// Included by the generated translation units of the sm80 family (cuda/gemm/kernels.cmake).
//
// Batch invariance: the threadblock/warp/instruction shapes and stage count are compile-time
// constants of each launcher; split-K is fixed at 1 (each threadblock walks all of K in order);
// the threadblock swizzle only decides which block computes which tile. A row's bits depend only
// on that row of A and on B. The tiles of one kernel set (kernels.cmake) share the K tile (32, its
// partial residue tile first), the warp's K (32: two mma.sync k16 steps per K tile, in order),
// the instruction and the epilogue, so each output element sees the same operations whichever
// tile computes it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_universal.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"
#include "gemm_args.h"

namespace jaxdet {
namespace gemm {
namespace sm80 {

// bf16/f16 tensor-op configuration of a TileM x TileN threadblock tile: K tile 32, warps of 32 K
// (the 128x128 tile: 64x64 warps, 4 stages, 64 KiB of shared memory, so it also fits sm_86/sm_89's
// 99 KiB; the narrower tiles: 32x32 warps and more stages, the same 48-64 KiB), instruction
// mma.sync m16n8k16.
constexpr int kTileK = 32;
template <int TileM, int TileN>
struct TensorOpShape {
  static constexpr int kWarpM = TileM / 2;
  static constexpr int kWarpN = TileN >= 64 ? TileN / 2 : TileN;
  static constexpr int kStages = TileM * TileN >= 128 * 128 ? 4 : 6;
  using Threadblock = cutlass::gemm::GemmShape<TileM, TileN, kTileK>;
  using Warp = cutlass::gemm::GemmShape<kWarpM, kWarpN, kTileK>;
  using Instruction = cutlass::gemm::GemmShape<16, 8, 16>;
};

template <class Element, class LayoutA, class LayoutB, class ElementOut, int TileM, int TileN>
using TensorOpGemm = cutlass::gemm::device::GemmUniversal<
    Element, LayoutA, Element, LayoutB, ElementOut, cutlass::layout::RowMajor, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, typename TensorOpShape<TileM, TileN>::Threadblock,
    typename TensorOpShape<TileM, TileN>::Warp, typename TensorOpShape<TileM, TileN>::Instruction,
    cutlass::epilogue::thread::LinearCombination<ElementOut, 128 / cutlass::sizeof_bits<ElementOut>::value, float,
                                                 float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, TensorOpShape<TileM, TileN>::kStages, 8, 8>;

// float32 SIMT configuration: 128x128x8 threadblock, 32x64x8 warps (8 warps), 1x1x1 FFMA, 3
// stages, alignment 1 (any shape).
template <class LayoutA, class LayoutB>
using SimtGemm = cutlass::gemm::device::GemmUniversal<
    float, LayoutA, float, LayoutB, float, cutlass::layout::RowMajor, float, cutlass::arch::OpClassSimt,
    cutlass::arch::Sm80, cutlass::gemm::GemmShape<128, 128, 8>, cutlass::gemm::GemmShape<32, 64, 8>,
    cutlass::gemm::GemmShape<1, 1, 1>, cutlass::epilogue::thread::LinearCombination<float, 1, float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, 3, 1, 1>;

template <class Gemm>
Status run(const GemmArgs& g, cudaStream_t stream) {
  using EA = typename Gemm::ElementA;
  using EB = typename Gemm::ElementB;
  using EC = typename Gemm::ElementC;
  if (g.m > INT32_MAX || g.n > INT32_MAX || g.k > INT32_MAX || g.l > INT32_MAX) {
    return "a dimension is larger than 2^31 - 1";
  }
  typename Gemm::Arguments args(
      cutlass::gemm::GemmUniversalMode::kBatched,
      cutlass::gemm::GemmCoord(static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(g.k)),
      static_cast<int>(g.l), {1.0f, g.beta}, static_cast<const EA*>(g.a), static_cast<const EB*>(g.b),
      static_cast<const EC*>(g.beta != 0.0f ? g.c : g.d), static_cast<EC*>(g.d), g.batch_a, g.batch_b,
      g.beta != 0.0f ? g.batch_c : g.batch_d, g.batch_d, g.lda, g.ldb, g.beta != 0.0f ? g.ldc : g.ldd, g.ldd);
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) {
    return "CUTLASS cannot run this problem: the sm_80 kernels need every operand's contiguous "
           "dimension to be a multiple of 8 elements (bfloat16/float16) and 16-byte aligned pointers";
  }
  if (Gemm::get_workspace_size(args) != 0) {
    return "internal error: the batched sm_80 GEMM asked for a workspace";
  }
  Gemm op;
  // initialize() caches the device properties (and the shared-memory attribute) per thread and
  // device on first use; afterwards it only builds the kernel parameters.
  cutlass::Status st = op.initialize(args, nullptr, stream);
  if (st == cutlass::Status::kSuccess) st = op.run(stream);
  if (st != cutlass::Status::kSuccess) {
    return std::string("CUTLASS launch failed: ") + cutlassGetStatusString(st);
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return std::string("launch: ") + cudaGetErrorString(e);
  return {};
}

// The launcher of one generated unit (cuda/gemm/kernels.cmake): the SIMT kernel for float32, the
// tensor-op kernel otherwise. CUTLASS 2.x epilogues take one type for C and D.
template <class Element, class LayoutA, class LayoutB, class ElementC, class ElementD, int TileM, int TileN>
Status launch(const GemmArgs& args, cudaStream_t stream) {
  static_assert(std::is_same_v<ElementC, ElementD>, "the sm_80 kernels read C in D's type");
  if constexpr (std::is_same_v<Element, float>) {
    static_assert(std::is_same_v<ElementD, float>, "the float32 SIMT kernel writes float32");
    static_assert(TileM == 128 && TileN == 128, "the float32 SIMT kernel has one tile, 128x128");
    return run<SimtGemm<LayoutA, LayoutB>>(args, stream);
  } else {
    using Gemm = TensorOpGemm<Element, LayoutA, LayoutB, ElementD, TileM, TileN>;
    // What every tile of a kernel set must share: the K tile, the warp's K, the instruction.
    static_assert(Gemm::GemmKernel::Mma::Shape::kK == kTileK, "every sm_80 tile has K tile 32");
    static_assert(Gemm::GemmKernel::Mma::Operator::Shape::kK == kTileK, "every sm_80 warp covers the K tile");
    static_assert(Gemm::GemmKernel::Mma::Operator::InstructionShape::kK == 16, "mma.sync of K depth 16");
    return run<Gemm>(args, stream);
  }
}

}  // namespace sm80
}  // namespace gemm
}  // namespace jaxdet
