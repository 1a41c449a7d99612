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

namespace narrow = jaxdet::gemm::narrow;
using Element = cutlass::bfloat16_t;

// Launches cycle through copies of B (together larger than L2), so each reads B from memory.
template <int TileN, int Stages>
float time_us(const std::vector<jaxdet::gemm::GemmArgs>& gs, int reps) {
  const auto kernel = narrow::narrow_gemm_kernel<Element, Element, TileN, Stages>;
  constexpr int smem = narrow::kSmemBytes<TileN, Stages>;
  constexpr int threads = narrow::Tile<TileN>::kThreads;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<narrow::Params> ps;
  for (const auto& g : gs) ps.push_back(narrow::make_params<TileN>(g));
  const dim3 grid = narrow::grid_of(ps[0]);
  for (int i = 0; i < 3; ++i) kernel<<<grid, threads, smem>>>(ps[i % ps.size()]);
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) kernel<<<grid, threads, smem>>>(ps[i % ps.size()]);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaGetLastError());
  return 1000.0f * ms / reps;
}

std::vector<uint16_t> bits_of(const jaxdet::gemm::GemmArgs& g) {
  std::vector<uint16_t> h(g.m * g.n);
  CHECK(cudaMemcpy(h.data(), g.d, h.size() * 2, cudaMemcpyDeviceToHost));
  return h;
}

// The package's launcher (the chunk workspace and its counters' memset included) on gs in turn;
// LayoutB ColumnMajor: B stored [N, K].
template <int TileN, class LayoutB = cutlass::layout::RowMajor>
float time_launch_us(const std::vector<jaxdet::gemm::GemmArgs>& gs, int reps) {
  const auto run = [](const jaxdet::gemm::GemmArgs& g) {
    const auto status =
        narrow::launch<Element, cutlass::layout::RowMajor, LayoutB, void, Element, narrow::kTileM, TileN>(g,
                                                                                                          nullptr);
    if (!status.empty()) {
      std::printf("launch: %s\n", status.c_str());
      std::exit(1);
    }
  };
  for (int i = 0; i < 3; ++i) run(gs[i % gs.size()]);
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) run(gs[i % gs.size()]);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaGetLastError());
  return 1000.0f * ms / reps;
}

// K beyond one chunk (8192), a CTA per chunk and tile through the launcher (the counters' memset
// included), against one pass over K without chunks (other bits: not the chunk tree).
template <int TileN>
void chunk_schedules(int K, int N, void* workspace, size_t workspace_bytes) {
  std::vector<uint16_t> ha(16 * int64_t{K}), hb(int64_t{K} * N);
  uint32_t x = 54321;
  auto next = [&x] {
    x = x * 1664525u + 1013904223u;
    return static_cast<uint16_t>(0x3c00 + ((x >> 16) & 0x3ff) + ((x >> 31) << 15));
  };
  for (auto& v : ha) v = next();
  for (auto& v : hb) v = next();
  const int copies = static_cast<int>(1 + (int64_t{256} << 20) / (hb.size() * 2));
  void *da, *db, *dd;
  CHECK(cudaMalloc(&da, ha.size() * 2));
  CHECK(cudaMalloc(&db, copies * hb.size() * 2));
  CHECK(cudaMalloc(&dd, 16 * int64_t{N} * 2));
  CHECK(cudaMemcpy(da, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
  for (int c = 0; c < copies; ++c) {
    CHECK(
        cudaMemcpy(static_cast<char*>(db) + c * hb.size() * 2, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
  }
  for (int M : {1, 4, 16}) {
    jaxdet::gemm::GemmArgs g;
    g.m = M;
    g.n = N;
    g.k = K;
    g.a = da;
    g.lda = K;
    g.ldb = N;
    g.d = dd;
    g.ldd = N;
    g.chunk_workspace = workspace;
    g.chunk_workspace_bytes = workspace_bytes;
    std::vector<jaxdet::gemm::GemmArgs> gs(copies, g);
    for (int c = 0; c < copies; ++c) gs[c].b = static_cast<char*>(db) + c * hb.size() * 2;
    const auto with = [&](int64_t chunk) {
      auto v = gs;
      for (auto& e : v) e.chunk = chunk;
      return v;
    };
    const float one_pass = time_launch_us<TileN>(with(0), 200);
    const float chunked = time_launch_us<TileN>(with(8192), 200);
    std::printf("| %d | %d | %d | 16x%d | %.1f | %.1f |\n", K, N, M, TileN, one_pass, chunked);
  }
  CHECK(cudaFree(da));
  CHECK(cudaFree(db));
  CHECK(cudaFree(dd));
}

// B stored [N, K] (dA's layout, the weight read transposed) against B stored [K, N] with the same
// values: the same products, so the same bits, through the launcher (K within one chunk).
template <int TileN>
void b_layouts(int K, int N) {
  std::vector<uint16_t> ha(16 * int64_t{K}), hb(int64_t{K} * N), hbt(hb.size());
  uint32_t x = 777;
  auto next = [&x] {
    x = x * 1664525u + 1013904223u;
    return static_cast<uint16_t>(0x3c00 + ((x >> 16) & 0x3ff) + ((x >> 31) << 15));
  };
  for (auto& v : ha) v = next();
  for (auto& v : hb) v = next();
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t n = 0; n < N; ++n) hbt[n * K + k] = hb[k * N + n];
  }
  const int copies = static_cast<int>(1 + (int64_t{256} << 20) / (hb.size() * 2));
  void *da, *db, *dbt, *dd;
  CHECK(cudaMalloc(&da, ha.size() * 2));
  CHECK(cudaMalloc(&db, copies * hb.size() * 2));
  CHECK(cudaMalloc(&dbt, copies * hb.size() * 2));
  CHECK(cudaMalloc(&dd, 16 * int64_t{N} * 2));
  CHECK(cudaMemcpy(da, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
  for (int c = 0; c < copies; ++c) {
    CHECK(
        cudaMemcpy(static_cast<char*>(db) + c * hb.size() * 2, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(static_cast<char*>(dbt) + c * hb.size() * 2, hbt.data(), hb.size() * 2,
                     cudaMemcpyHostToDevice));
  }
  for (int M : {1, 4, 16}) {
    jaxdet::gemm::GemmArgs g;
    g.m = M;
    g.n = N;
    g.k = K;
    g.a = da;
    g.lda = K;
    g.d = dd;
    g.ldd = N;
    std::vector<jaxdet::gemm::GemmArgs> rows(copies, g), cols(copies, g);
    for (int c = 0; c < copies; ++c) {
      rows[c].b = static_cast<char*>(db) + c * hb.size() * 2;
      rows[c].ldb = N;
      cols[c].b = static_cast<char*>(dbt) + c * hb.size() * 2;
      cols[c].ldb = K;
    }
    CHECK(cudaMemset(dd, 0xff, 16 * int64_t{N} * 2));
    const float t_rows = time_launch_us<TileN>(rows, 200);
    const auto ref = bits_of(g);
    CHECK(cudaMemset(dd, 0xff, 16 * int64_t{N} * 2));
    const float t_cols = time_launch_us<TileN, cutlass::layout::ColumnMajor>(cols, 200);
    const double bytes = 2.0 * (double(K) * N + double(M) * K + double(M) * N);
    std::printf("| %d | %d | %d | 16x%d | %.1f | %.1f | %.0f | %s |\n", K, N, M, TileN, t_rows, t_cols,
                bytes / (t_cols * 1e3), bits_of(g) == ref ? "equal" : "DIFFER");
  }
  CHECK(cudaFree(da));
  CHECK(cudaFree(db));
  CHECK(cudaFree(dbt));
  CHECK(cudaFree(dd));
}

int main() {
  // (K, N): the benchmark's products and a d-2048 model's decode products (attention output and
  // down projections 2048 wide, q|k|v 4096, gate|up 11264, the head 32000), N = 2000 not a
  // multiple of 32.
  const int shapes[][2] = {{14336, 4096}, {4096, 4096}, {2048, 4096}, {2048, 11264},
                           {2048, 32000}, {2048, 2048}, {5632, 2048}, {2048, 2000}};
  const int ms[] = {1, 4, 16};
  const int reps = 200;
  std::printf(
      "| K | N | M | 16x32, 4 stages us | 6 | 8 | 12 | 16x16, 8 | 12 | 16 | 16x64, 6 | 8 | HBM GB/s: 16x32 at 8 | "
      "best | bits vs 16x32 at 8 |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& s : shapes) {
    const int K = s[0], N = s[1];
    std::vector<uint16_t> ha(16 * int64_t{K}), hb(int64_t{K} * N);
    uint32_t x = 12345;
    auto next = [&x] {
      x = x * 1664525u + 1013904223u;  // bf16 values in [-2, 2)
      return static_cast<uint16_t>(0x3c00 + ((x >> 16) & 0x3ff) + ((x >> 31) << 15));
    };
    for (auto& v : ha) v = next();
    for (auto& v : hb) v = next();
    const int copies = static_cast<int>(1 + (int64_t{256} << 20) / (hb.size() * 2));
    void *da, *db, *dd;
    CHECK(cudaMalloc(&da, ha.size() * 2));
    CHECK(cudaMalloc(&db, copies * hb.size() * 2));
    CHECK(cudaMalloc(&dd, 16 * int64_t{N} * 2));
    CHECK(cudaMemcpy(da, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
    for (int c = 0; c < copies; ++c) {
      CHECK(cudaMemcpy(static_cast<char*>(db) + c * hb.size() * 2, hb.data(), hb.size() * 2,
                       cudaMemcpyHostToDevice));
    }
    for (int M : ms) {
      jaxdet::gemm::GemmArgs g;
      g.m = M;
      g.n = N;
      g.k = K;
      g.a = da;
      g.lda = K;
      g.b = db;
      g.ldb = N;
      g.d = dd;
      g.ldd = N;
      std::vector<jaxdet::gemm::GemmArgs> gs(copies, g);
      for (int c = 0; c < copies; ++c) gs[c].b = static_cast<char*>(db) + c * hb.size() * 2;
      // D is filled with NaNs before each variant, so an element one leaves unwritten shows.
      const auto cleared = [&] { CHECK(cudaMemset(dd, 0xff, 16 * int64_t{N} * 2)); };
      float t[9];
      cleared();
      t[2] = time_us<32, 8>(gs, reps);
      const auto ref = bits_of(g);
      int differ = 0;
      const auto check = [&] {
        differ += bits_of(g) != ref;
        cleared();
      };
      cleared();
      t[0] = time_us<32, 4>(gs, reps);
      check();
      t[1] = time_us<32, 6>(gs, reps);
      check();
      t[3] = time_us<32, 12>(gs, reps);
      check();
      t[4] = time_us<16, 8>(gs, reps);
      check();
      t[5] = time_us<16, 12>(gs, reps);
      check();
      t[6] = time_us<16, 16>(gs, reps);
      check();
      t[7] = time_us<64, 6>(gs, reps);
      check();
      t[8] = time_us<64, 8>(gs, reps);
      check();
      float best = t[0];
      for (int i = 1; i < 9; ++i) best = t[i] < best ? t[i] : best;
      const double bytes = 2.0 * (double(K) * N + double(M) * K + double(M) * N);
      std::printf(
          "| %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %s |\n",
          K, N, M, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], bytes / (t[2] * 1e3),
          bytes / (best * 1e3), differ ? "DIFFER" : "equal");
    }
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaFree(dd));
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
