// sm_80+ GEMM launchers (CUTLASS 2.x GemmUniversal, batched mode): the bf16/f16 tensor-op kernels
// (mma.sync m16n8k16, multistage cp.async) and the true-float32 SIMT kernel (FFMA; never TF32).
// Included by the generated translation units of the sm80 family (cuda/gemm/kernels.cmake).
//
// Batch invariance: the threadblock/warp/instruction shapes and stage count are compile-time
// constants of each launcher; split-K is fixed at 1 (each threadblock walks all of K in order);
// the threadblock swizzle only decides which block computes which tile. A row's bits depend only
// on that row of A and on B.
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

// bf16/f16 tensor-op configuration: 128x128x32 threadblock, 64x64x32 warps (4 warps), 4 stages
// (64 KiB of shared memory, so it also fits sm_86/sm_89's 99 KiB).
template <class Element, class LayoutA, class LayoutB, class ElementOut>
using TensorOpGemm = cutlass::gemm::device::GemmUniversal<
    Element, LayoutA, Element, LayoutB, ElementOut, cutlass::layout::RowMajor, float,
    cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, cutlass::gemm::GemmShape<128, 128, 32>,
    cutlass::gemm::GemmShape<64, 64, 32>, cutlass::gemm::GemmShape<16, 8, 16>,
    cutlass::epilogue::thread::LinearCombination<ElementOut, 128 / cutlass::sizeof_bits<ElementOut>::value,
                                                 float, float>,
    cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, 4, 8, 8>;

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
      g.beta != 0.0f ? g.batch_c : g.batch_d, g.batch_d, g.lda, g.ldb, g.beta != 0.0f ? g.ldc : g.ldd,
      g.ldd);
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
template <class Element, class LayoutA, class LayoutB, class ElementC, class ElementD>
Status launch(const GemmArgs& args, cudaStream_t stream) {
  static_assert(std::is_same_v<ElementC, ElementD>, "the sm_80 kernels read C in D's type");
  if constexpr (std::is_same_v<Element, float>) {
    static_assert(std::is_same_v<ElementD, float>, "the float32 SIMT kernel writes float32");
    return run<SimtGemm<LayoutA, LayoutB>>(args, stream);
  } else {
    return run<TensorOpGemm<Element, LayoutA, LayoutB, ElementD>>(args, stream);
  }
}

}  // namespace sm80
}  // namespace gemm
}  // namespace jaxdet
