// Time of the forward's narrow tiles (cuda/gemm/gemm_narrow.cuh; 16x64 as a candidate for wide
// outputs) by pipeline depth and width, side by side in one process, with the bits of each against
// 16x32 at the launcher's depth (a depth decides how many K tiles are in flight and a width which
// CTA computes a column, never what a K step computes); then K beyond one chunk (a CTA per chunk)
// and dA's B layout. The GEMM against jnp.dot: benchmarks/matmul_bench.py.
//
// Build and run on a Hopper GPU (tools/gpu_session.sh narrow-stages):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I cuda -I <cutlass>/include \
//     tools/experiments/gemm_narrow_stages.cu -o ns && ./ns
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_check.h"
#include "gemm/gemm_narrow.cuh"
#include "narrow_probe.h"

namespace narrow = jaxdet::gemm::narrow;
using Element = cutlass::bfloat16_t;
using jaxdet::gemm::GemmArgs;
using narrow_probe::bits_of;

// The package's launcher (the chunk workspace and its counters' memset included) on gs in turn;
// LayoutB ColumnMajor: B stored [N, K].
template <int TileN, class LayoutB = cutlass::layout::RowMajor>
float time_launch_us(const std::vector<GemmArgs>& gs, int reps) {
  return narrow_probe::time_us(
      [&](int i) {
        const auto status =
            narrow::launch<Element, cutlass::layout::RowMajor, LayoutB, void, Element, narrow::kTileM, TileN>(
                gs[i % gs.size()], nullptr);
        if (!status.empty()) {
          std::printf("launch: %s\n", status.c_str());
          std::exit(1);
        }
      },
      reps);
}

// K beyond one chunk (8192), a CTA per chunk and tile through the launcher (the counters' memset
// included), against one pass over K without chunks (other bits: not the chunk tree).
template <int TileN>
void chunk_schedules(int K, int N, void* workspace, size_t workspace_bytes) {
  const narrow_probe::Operands ops(N, narrow_probe::random_bf16(16 * int64_t{K}, 54321),
                                  narrow_probe::random_bf16(int64_t{K} * N, 12345));
  for (int M : {1, 4, 16}) {
    auto gs = ops.args(M, K, N);
    for (auto& g : gs) g.chunk_workspace = workspace, g.chunk_workspace_bytes = workspace_bytes;
    const auto with = [&](int64_t chunk) {
      auto v = gs;
      for (auto& e : v) e.chunk = chunk;
      return v;
    };
    const float one_pass = time_launch_us<TileN>(with(0), 200);
    const float chunked = time_launch_us<TileN>(with(8192), 200);
    std::printf("| %d | %d | %d | 16x%d | %.1f | %.1f |\n", K, N, M, TileN, one_pass, chunked);
  }
}

// B stored [N, K] (dA's layout, the weight read transposed) against B stored [K, N] with the same
// values: the same products, so the same bits, through the launcher (K within one chunk).
template <int TileN>
void b_layouts(int K, int N) {
  const auto ha = narrow_probe::random_bf16(16 * int64_t{K}, 777), hb = narrow_probe::random_bf16(int64_t{K} * N, 778);
  std::vector<uint16_t> hbt(hb.size());
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n) hbt[n * K + k] = hb[k * N + n];
  }
  const narrow_probe::Operands rows_major(N, ha, hb), columns_major(N, ha, hbt);
  for (int M : {1, 4, 16}) {
    const auto rows = rows_major.args(M, K, N), cols = columns_major.args(M, K, K);
    rows_major.clear_d();
    const float t_rows = time_launch_us<TileN>(rows, 200);
    const auto ref = bits_of(rows[0]);
    columns_major.clear_d();
    const float t_cols = time_launch_us<TileN, cutlass::layout::ColumnMajor>(cols, 200);
    const double bytes = 2.0 * (double(K) * N + double(M) * K + double(M) * N);
    std::printf("| %d | %d | %d | 16x%d | %.1f | %.1f | %.0f | %s |\n", K, N, M, TileN, t_rows, t_cols,
                bytes / (t_cols * 1e3), bits_of(cols[0]) == ref ? "equal" : "DIFFER");
  }
}

int main() {
  // (K, N): the benchmark's products and a d-2048 model's decode products (attention output and
  // down projections 2048 wide, q|k|v 4096, gate|up 11264, the head 32000), N = 2000 not a
  // multiple of 32.
  const int shapes[][2] = {{14336, 4096}, {4096, 4096}, {2048, 4096}, {2048, 11264},
                           {2048, 32000}, {2048, 2048}, {5632, 2048}, {2048, 2000}};
  const int reps = 200;
  std::printf(
      "| K | N | M | 16x32, 4 stages us | 6 | 8 | 12 | 16x16, 8 | 12 | 16 | 16x64, 6 | 8 | HBM GB/s: 16x32 at 8 | "
      "best | bits vs 16x32 at 8 |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& s : shapes) {
    const int K = s[0], N = s[1];
    const narrow_probe::Operands ops(N, narrow_probe::random_bf16(16 * int64_t{K}, 12345),
                                    narrow_probe::random_bf16(int64_t{K} * N, 67890));
    for (int M : {1, 4, 16}) {
      const auto gs = ops.args(M, K, N);
      float t[9];
      ops.clear_d();
      t[2] = narrow_probe::time_kernel_us<32, 8>(gs, reps);
      const auto ref = bits_of(gs[0]);
      int differ = 0;
      const auto check = [&] {
        differ += bits_of(gs[0]) != ref;
        ops.clear_d();
      };
      ops.clear_d();
      t[0] = narrow_probe::time_kernel_us<32, 4>(gs, reps);
      check();
      t[1] = narrow_probe::time_kernel_us<32, 6>(gs, reps);
      check();
      t[3] = narrow_probe::time_kernel_us<32, 12>(gs, reps);
      check();
      t[4] = narrow_probe::time_kernel_us<16, 8>(gs, reps);
      check();
      t[5] = narrow_probe::time_kernel_us<16, 12>(gs, reps);
      check();
      t[6] = narrow_probe::time_kernel_us<16, 16>(gs, reps);
      check();
      t[7] = narrow_probe::time_kernel_us<64, 6>(gs, reps);
      check();
      t[8] = narrow_probe::time_kernel_us<64, 8>(gs, reps);
      check();
      float best = t[0];
      for (int i = 1; i < 9; ++i) best = t[i] < best ? t[i] : best;
      const double bytes = 2.0 * (double(K) * N + double(M) * K + double(M) * N);
      std::printf(
          "| %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %s |\n",
          K, N, M, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], bytes / (t[2] * 1e3),
          bytes / (best * 1e3), differ ? "DIFFER" : "equal");
    }
  }

  std::printf(
      "\n| K | N | M | tile | one pass, no chunks us | chunks of 8192, a CTA each |\n|---|---|---|---|---|---|\n");
  const size_t workspace_bytes = size_t{64} << 20;
  void* workspace;
  CHECK(cudaMalloc(&workspace, workspace_bytes));
  chunk_schedules<32>(14336, 4096, workspace, workspace_bytes);
  chunk_schedules<16>(14336, 2048, workspace, workspace_bytes);
  chunk_schedules<16>(28672, 1024, workspace, workspace_bytes);
  CHECK(cudaFree(workspace));

  // dA's products at M <= 16 (the transposed weight of a 4096 x 4096, 14336 x 4096 -> its 4096
  // wide side, and d-2048 decode layers), B stored [N, K] against [K, N].
  std::printf(
      "\n| K | N | M | tile | B [K, N] us | B [N, K] us | HBM GB/s, [N, K] | bits [N, K] vs [K, N] "
      "|\n|---|---|---|---|---|---|---|---|\n");
  b_layouts<32>(4096, 4096);
  b_layouts<32>(8192, 4096);
  b_layouts<16>(2048, 2048);
  b_layouts<16>(5632, 2048);
  return 0;
}
