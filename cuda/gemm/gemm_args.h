// Host-side description of one GEMM launch, shared by the FFI handlers (matmul_cuda.cu) and the
// generated CUTLASS instantiations (cuda/gemm/kernels.cmake). No CUTLASS here, so the dispatcher
// compiles fast and the instantiations can live in their own translation units (and their own
// CUDA architectures).
//
// Every launcher computes, for l < L, m < M, n < N:
//   D[l](m, n) = sum_{k ascending in fixed tiles} opA[l](m, k) * opB[l](k, n)   (f32 accumulate)
//                (+ C[l](m, n) when beta == 1)
// with the reduction order fixed by the launcher's compile-time configuration alone: no stream-K,
// no atomics, nothing chosen from M, N, K or L at run time. The cooperative Hopper launchers also
// take `chunk` (below): then each chunk of K is such a sum from zero and the chunks meet by the
// canonical tree, however the units are dealt to CTAs.
//
// A kernel set (one entry of the list in kernels.cmake) holds one launcher per output tile shape.
// Its tiles differ only in how the output is cut into tiles and how tiles go to CTAs: they share
// the K tile, the MMA instruction's K depth, the mainloop and the epilogue arithmetic, so every
// tile computes every output element with the same sequence of operations (static_asserts in
// gemm_sm90.cuh / gemm_sm80.cuh; bitwise checks in tests/test_gemm_buckets.py). Which tile runs
// is chosen per call from the problem's shape (matmul_cuda.cu, choose_tile); it cannot change a bit.
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
  // The chunk rule inside one launch (Hopper's cooperative tiles, gemm_sm90_chunks.cuh): K is cut
  // into chunks of `chunk` elements (a multiple of the K tile) whose float32 partials meet by the
  // canonical tree; 0: one chunk. The workspace holds the partials (and split-K's flags).
  int64_t chunk = 0;
  void* chunk_workspace = nullptr;
  size_t chunk_workspace_bytes = 0;
};

// The forward and dA sets' mma.sync few-row tiles (gemm_narrow.cuh), which the dispatcher recognises:
// 16 rows of D per CTA (two mma n8 blocks) by 32 or 16 columns (two or one mma m16 blocks).
namespace narrow {
constexpr int kTileM = 16;
constexpr bool is_narrow_tile(int tile_m, int tile_n) {
  return tile_m == kTileM && (tile_n == 32 || tile_n == 16);
}
}  // namespace narrow

// Empty string on success, otherwise a message (the caller prefixes the FFI target's name).
using Status = std::string;

// A launcher: one CUTLASS instantiation, generated from the list in cuda/gemm/kernels.cmake,
// which also writes the header declaring them all (generated/gemm_launchers.h).
#define JAXDET_GEMM_LAUNCHER(name) Status name(const GemmArgs& args, cudaStream_t stream)
using Launcher = Status (*)(const GemmArgs&, cudaStream_t);

// One tile shape of a kernel set: the CTA's output tile (rows x columns) and its launcher.
struct TileKernel {
  int tile_m;
  int tile_n;
  Launcher launch;
};

// The tiles of one kernel set, largest first (kernels.cmake checks the order).
struct KernelSet {
  const TileKernel* tiles;
  int count;
};

}  // namespace gemm
}  // namespace jaxdet
