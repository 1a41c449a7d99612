// What the narrow GEMM probes (gemm_narrow_stages.cu, gemm_narrow_ws.cu) share: bfloat16 operands
// on the device with B in copies that together exceed L2 (launches cycle through them, so each
// reads B from memory), the launch-timing loop, the package's kernel launched directly, and D's bits.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda_check.h"
#include "gemm/gemm_args.h"
#include "gemm/gemm_narrow.cuh"

namespace narrow_probe {

// bfloat16 values in [-2, 2) from a seeded linear congruential generator.
inline std::vector<uint16_t> random_bf16(size_t count, uint32_t seed) {
  std::vector<uint16_t> v(count);
  for (auto& e : v) {
    seed = seed * 1664525u + 1013904223u;
    e = static_cast<uint16_t>(0x3c00 + ((seed >> 16) & 0x3ff) + ((seed >> 31) << 15));
  }
  return v;
}

// A [16, K], copies of B (K * N elements, as stored) and D [16, N] on the device.
struct Operands {
  void* a = nullptr;
  void* b = nullptr;
  void* d = nullptr;
  int copies = 0;
  size_t b_bytes = 0;
  int64_t n = 0;

  Operands(int64_t n_, const std::vector<uint16_t>& ha, const std::vector<uint16_t>& hb)
      : copies(static_cast<int>(1 + (int64_t{256} << 20) / (hb.size() * 2))), b_bytes(hb.size() * 2), n(n_) {
    CHECK(cudaMalloc(&a, ha.size() * 2));
    CHECK(cudaMalloc(&b, copies * b_bytes));
    CHECK(cudaMalloc(&d, 16 * n * 2));
    CHECK(cudaMemcpy(a, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
    for (int c = 0; c < copies; ++c) CHECK(cudaMemcpy(copy(c), hb.data(), b_bytes, cudaMemcpyHostToDevice));
  }
  Operands(const Operands&) = delete;
  Operands& operator=(const Operands&) = delete;
  ~Operands() {
    cudaFree(a);
    cudaFree(b);
    cudaFree(d);
  }
  void* copy(int c) const { return static_cast<char*>(b) + c * b_bytes; }

  // The problem of M rows through copy i of B for the i-th entry; ldb: B's leading dimension as
  // stored (N for [K, N], K for [N, K]).
  std::vector<jaxdet::gemm::GemmArgs> args(int64_t m, int64_t k, int64_t ldb) const {
    jaxdet::gemm::GemmArgs g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.a = a;
    g.lda = k;
    g.ldb = ldb;
    g.d = d;
    g.ldd = n;
    std::vector<jaxdet::gemm::GemmArgs> gs(copies, g);
    for (int c = 0; c < copies; ++c) gs[c].b = copy(c);
    return gs;
  }

  // D filled with NaNs (bits 0xffff), so an element a kernel leaves unwritten shows.
  void clear_d() const {
    CHECK(cudaMemset(d, 0xff, 16 * n * 2));
    CHECK(cudaDeviceSynchronize());
  }
};

// Microseconds per launch of `reps` launches, run(i) issuing the i-th into `stream`, after three
// that warm up; events recorded in `stream`.
template <class Run>
float time_us(Run run, int reps, cudaStream_t stream = nullptr) {
  for (int i = 0; i < 3; ++i) run(i);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < reps; ++i) run(i);
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return 1000.0f * ms / reps;
}

// The package's narrow kernel (bfloat16), TileN columns and Stages deep, launched directly on gs in turn.
template <int TileN, int Stages>
float time_kernel_us(const std::vector<jaxdet::gemm::GemmArgs>& gs, int reps) {
  namespace narrow = jaxdet::gemm::narrow;
  const auto kernel = narrow::narrow_gemm_kernel<cutlass::bfloat16_t, cutlass::bfloat16_t, TileN, Stages>;
  constexpr int smem = narrow::kSmemBytes<TileN, Stages>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<narrow::Params> ps;
  for (const auto& g : gs) ps.push_back(narrow::make_params<TileN>(g));
  const dim3 grid = narrow::grid_of(ps[0]);
  return time_us([&](int i) { kernel<<<grid, narrow::Tile<TileN>::kThreads, smem>>>(ps[i % ps.size()]); }, reps);
}

inline std::vector<uint16_t> bits_of(const jaxdet::gemm::GemmArgs& g) {
  std::vector<uint16_t> h(g.m * g.n);
  CHECK(cudaMemcpy(h.data(), g.d, h.size() * 2, cudaMemcpyDeviceToHost));
  return h;
}

}  // namespace narrow_probe
