// What the CUDA GEMM dispatcher decides, for the tests and the report (bound in cuda/module.cc).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace jaxdet {

// The output tile (rows, columns) that jaxdet_gemm runs on the current CUDA device for one GEMM
// of l batches of m x n outputs (after the handler folds a shared b's batch into the rows), with
// `dtype` "float32", "bfloat16" or "float16", and a float32 output for half inputs when `out_f32`.
// The testing switch JAXDET_TESTING applies as in the handler. Throws std::invalid_argument for a
// bad argument and std::runtime_error without a usable CUDA device.
std::pair<int, int> gemm_cuda_tile(const std::string& dtype, bool transpose_a, bool transpose_b, bool out_f32,
                                   int64_t m, int64_t n, int64_t l);

// Every tile of the kernel set that jaxdet_gemm runs on the current CUDA device for these
// operands, largest first (the tiles choose_tile picks from; JAXDET_TESTING=gemm=sm80 applies).
std::vector<std::pair<int, int>> gemm_cuda_tiles(const std::string& dtype, bool transpose_a, bool transpose_b,
                                                 bool out_f32);

}  // namespace jaxdet
