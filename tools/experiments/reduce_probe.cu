// Probe: the CUDA kernels of jaxdet_reduce (cuda/reduce/reduce_cuda.cu) without the package: its
// Launch<S, O> against a host fold of the rule (docs/reduce.md), bitwise, for every kernel path
// (rows and columns, one chunk and many, 16-byte, 4-byte and element copies from aligned and
// misaligned bases, every dtype and result dtype), then kernel times of the big cases (CUDA events,
// 20 back-to-back launches). `reduce_probe s` runs the correctness cases only (for
// compute-sanitizer). It answered "are the kernels exact and how fast are they" before the
// package could be built on a GPU; the figures of docs/reduce.md ("Kernels and cost") come from it.
//   nvcc -std=c++17 -O3 -arch=sm_90a -I cuda -I $(python3 -c 'import jax.ffi as f; print(f.include_dir())') \
//     tools/experiments/reduce_probe.cu -o /tmp/reduce_probe && /tmp/reduce_probe
#include <cstdio>
#include <random>
#include <vector>

#include "reduce/reduce_cuda.cu"
using namespace jaxdet;
static int failures = 0;

template <typename S, typename O>
void run(int64_t A, int64_t K, int64_t B, int off, int reps, const char* tag, bool /*timed shape*/) {
  using Bits = typename S::Bits;
  using OB = typename O::Bits;
  const int64_t n = A * K * B;
  std::vector<Bits> hx(n + off);
  std::mt19937 rng(A * 131 + K * 7 + B + off);
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> ex(-6, 6);
  for (auto& v : hx) v = S::store(std::ldexp(nd(rng), ex(rng)));
  reduce::Dims d;
  d.A = A;
  d.K = K;
  d.B = B;
  d.chunk = 8192;
  d.chunks = (K + 8191) / 8192;
  std::vector<OB> want(A * B, 0), got(A * B, 1);
  std::vector<float> part(d.chunks);
  for (int64_t a = 0; a < A; ++a)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t c = 0; c < d.chunks; ++c) {
        float acc = 0.0f;
        for (int64_t k = c * 8192; k < std::min(K, c * 8192 + 8192); ++k)
          acc = acc + S::load(hx[off + (a * K + k) * B + b]);
        part[c] = acc;
      }
      want[a * B + b] = O::store(detmath::tree_fold<float>(
          d.chunks, [&](int64_t c) { return part[c]; }, [](float l, float r) { return l + r; }));
    }
  Bits* dx;
  OB* dout;
  void* ws = nullptr;
  cudaMalloc(&dx, sizeof(Bits) * (n + off + 1));
  cudaMalloc(&dout, sizeof(OB) * (A * B + 1));
  const int64_t wb = reduce::workspace_bytes(d);
  if (wb) cudaMalloc(&ws, wb);
  cudaMemcpy(dx, hx.data(), sizeof(Bits) * (n + off), cudaMemcpyHostToDevice);
  printf("%s A=%lld K=%lld B=%lld off=%d %zu->%zu:", tag, (long long)A, (long long)K, (long long)B, off,
         sizeof(Bits), sizeof(OB));
  {
    cudaMemset(dout, 0xFF, sizeof(OB) * A * B);
    cudaError_t e = Launch<S, O>(0, dx + off, dout, static_cast<float*>(ws), d);
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    cudaMemcpy(got.data(), dout, sizeof(OB) * A * B, cudaMemcpyDeviceToHost);
    int64_t bad = 0;
    for (int64_t i = 0; i < A * B; ++i) bad += got[i] != want[i];
    if (bad || e != cudaSuccess) {
      ++failures;
      printf(" [%s %lld]", e != cudaSuccess ? cudaGetErrorString(e) : "DIFFER", (long long)bad);
    }
    if (reps > 0) {
      cudaEvent_t t0, t1;
      cudaEventCreate(&t0);
      cudaEventCreate(&t1);
      for (int i = 0; i < 3; ++i) Launch<S, O>(0, dx + off, dout, static_cast<float*>(ws), d);
      cudaEventRecord(t0);
      for (int i = 0; i < reps; ++i) Launch<S, O>(0, dx + off, dout, static_cast<float*>(ws), d);
      cudaEventRecord(t1);
      cudaEventSynchronize(t1);
      float ms;
      cudaEventElapsedTime(&ms, t0, t1);
      printf(" %.1f us %.0f GB/s", 1e3 * ms / reps, sizeof(Bits) * n / (1e3 * ms / reps) / 1e3);
    }
  }
  printf(failures ? "\n" : " ok\n");
  cudaFree(dx);
  cudaFree(dout);
  if (ws) cudaFree(ws);
}
int main(int argc, char** argv) {
  const bool sanitize = argc > 1 && argv[1][0] == 's';
  const long long shapes[][3] = {{1, 1, 1},
                                 {3, 1, 5},
                                 {2, 300, 3},
                                 {4, 8193, 1},
                                 {1, 8193, 5},
                                 {2, 5 * 8192 + 17, 3},
                                 {3, 4 * 8192, 1},
                                 {1, 2048, 512},
                                 {2048, 512, 1},
                                 {1, 4096, 384},
                                 {8, 16 * 8192 + 3, 1},
                                 {3, 9 * 8192, 5},
                                 {1, 1027, 33},
                                 {33, 1027, 1},
                                 {1, 4096, 34},
                                 {33, 1030, 1},
                                 {2, 100, 7},
                                 {1, 5 * 8192 + 17, 1},
                                 {300, 3, 1000},
                                 {1000, 20000, 1},
                                 {1, 20000, 300},
                                 {200, 70, 1}};
  for (auto& s : shapes)
    for (int off = 0; off < 2; ++off) {
      run<F32Storage, F32Storage>(s[0], s[1], s[2], off, 0, "f32 ", !sanitize);
      run<BF16Storage, BF16Storage>(s[0], s[1], s[2], off, 0, "bf16", !sanitize);
      run<BF16Storage, F32Storage>(s[0], s[1], s[2], off, 0, "b>32", !sanitize);
      run<F16Storage, F16Storage>(s[0], s[1], s[2], off, 0, "f16 ", !sanitize);
      run<F16Storage, F32Storage>(s[0], s[1], s[2], off, 0, "h>32", !sanitize);
    }
  if (!sanitize) {
    const long long big[][3] = {{1, 8192, 2048},      {8192, 2048, 1},  {8, 128256, 1},    {1, 65536, 4096},
                                {1, 16384 * 1024, 1}, {64, 2048, 1024}, {1, 65536 * 8, 1}, {3, 8192 * 40, 2}};
    for (auto& s : big) {
      run<BF16Storage, BF16Storage>(s[0], s[1], s[2], 0, 20, "bf16", true);
      run<F32Storage, F32Storage>(s[0], s[1], s[2], 0, 20, "f32 ", true);
    }
  }
  printf("failures: %d\n", failures);
  return failures != 0;
}
