// Host-side description of one GEMM launch, shared by the FFI handlers (matmul_cuda.cu) and the
// CUTLASS instantiations (gemm_sm90_*.cu, gemm_sm80_*.cu, gemm_simt_*.cu). No CUTLASS here, so the
// dispatcher compiles fast and the instantiations can live in their own translation units (and
// their own CUDA architectures).
//
// Every launcher computes, for l < L, m < M, n < N:
//   D[l](m, n) = sum_{k ascending in fixed tiles} opA[l](m, k) * opB[l](k, n)   (f32 accumulate)
//                (+ C[l](m, n) when beta == 1)
// with the reduction order fixed by the launcher's compile-time configuration alone: no split-K,
// no stream-K, no atomics, nothing chosen from M, N, K or L at run time.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jaxdet {
namespace gemm {

// Strides are in elements. "ld" is the stride of the non-contiguous mode of the operand in the
// layout the launcher's name gives (rows of a row-major operand, columns of a column-major one);
// "batch" the stride between consecutive l (0 broadcasts).
struct GemmArgs {
  int device = 0;
  int sm_count = 0;
  int64_t m = 0, n = 0, k = 0, l = 1;
  const void* a = nullptr;
  int64_t lda = 0, batch_a = 0;
  const void* b = nullptr;
  int64_t ldb = 0, batch_b = 0;
  const void* c = nullptr;  // read only when beta != 0 (f32 C of the weight-gradient kernels)
  int64_t ldc = 0, batch_c = 0;
  float beta = 0.0f;
  void* d = nullptr;
  int64_t ldd = 0, batch_d = 0;
};

// Empty string on success, otherwise a message (the caller prefixes the FFI target's name).
using Status = std::string;

// Launchers. Layout letters: first = A, second = B; N = row-major as stored ([M,K] / [K,N]), T =
// read transposed in place (A stored [K,M] = column-major A; B stored [N,K] = column-major B).
// Output element: same as the inputs, or f32 ("f32" in the name). D is always row-major [M,N].
#define JAXDET_GEMM_LAUNCHER(name) Status name(const GemmArgs& args, cudaStream_t stream)

// Hopper (sm_90a), CUTLASS 3.x TMA warp-specialized, persistent data-parallel scheduler:
// cooperative 128x256x64, cluster 1x1x1, for nn, nt and the weight gradient (tn). The tn
// launchers differ only in their epilogue's C and D types: the mainloop, and so every partial
// sum, is the same kernel configuration.
JAXDET_GEMM_LAUNCHER(sm90_bf16_nn_bf16);
JAXDET_GEMM_LAUNCHER(sm90_bf16_nn_f32);
JAXDET_GEMM_LAUNCHER(sm90_bf16_nt_bf16);
JAXDET_GEMM_LAUNCHER(sm90_bf16_nt_f32);
JAXDET_GEMM_LAUNCHER(sm90_bf16_tn_f32acc);  // D = C + A^T B, f32 C/D (weight gradient chunks)
JAXDET_GEMM_LAUNCHER(sm90_bf16_tn_bf16);    // D = A^T B, bf16 D (a weight gradient of one chunk)
JAXDET_GEMM_LAUNCHER(sm90_bf16_tn_f32acc_bf16);  // D = C + A^T B, f32 C, bf16 D (its last chunk)
JAXDET_GEMM_LAUNCHER(sm90_f16_nn_f16);
JAXDET_GEMM_LAUNCHER(sm90_f16_nn_f32);
JAXDET_GEMM_LAUNCHER(sm90_f16_nt_f16);
JAXDET_GEMM_LAUNCHER(sm90_f16_nt_f32);
JAXDET_GEMM_LAUNCHER(sm90_f16_tn_f32acc);
JAXDET_GEMM_LAUNCHER(sm90_f16_tn_f16);
JAXDET_GEMM_LAUNCHER(sm90_f16_tn_f32acc_f16);

// sm_80 and later (CUTLASS 2.x multistage tensor-op kernels, mma.sync), all four layouts; the
// *_f32 launchers also take beta = 1 with an f32 C (the weight gradient off Hopper).
#define JAXDET_SM80_LAUNCHERS(T)                                                          \
  JAXDET_GEMM_LAUNCHER(sm80_##T##_nn_##T); JAXDET_GEMM_LAUNCHER(sm80_##T##_nn_f32);      \
  JAXDET_GEMM_LAUNCHER(sm80_##T##_nt_##T); JAXDET_GEMM_LAUNCHER(sm80_##T##_nt_f32);      \
  JAXDET_GEMM_LAUNCHER(sm80_##T##_tn_##T); JAXDET_GEMM_LAUNCHER(sm80_##T##_tn_f32);      \
  JAXDET_GEMM_LAUNCHER(sm80_##T##_tt_##T); JAXDET_GEMM_LAUNCHER(sm80_##T##_tt_f32);
JAXDET_SM80_LAUNCHERS(bf16)
JAXDET_SM80_LAUNCHERS(f16)
#undef JAXDET_SM80_LAUNCHERS

// True float32 on every architecture (CUTLASS 2.x SIMT sgemm: FFMA, never TF32); any alignment.
JAXDET_GEMM_LAUNCHER(simt_f32_nn);
JAXDET_GEMM_LAUNCHER(simt_f32_nt);
JAXDET_GEMM_LAUNCHER(simt_f32_tn);
JAXDET_GEMM_LAUNCHER(simt_f32_tt);

}  // namespace gemm
}  // namespace jaxdet
