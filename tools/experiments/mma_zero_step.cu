// Does a k16 step whose products are all zero leave the accumulator unchanged? One mma.sync
// m16n8k16 (bf16 and f16 operands, float32 accumulators) with A = B = +0 and, as C, float32 bit
// patterns of every kind: normals, subnormals (every exponent-0 mantissa bit), +-0, +-inf and NaNs
// with payloads. Counts the accumulators whose bits change, besides -0 becoming +0. On Hopper a k16
// step of mma.sync gives the bits of wgmma's (the GEMM's 16x32 tile rests on it), so the answer says
// whether a kernel may skip the steps wholly past K that the Hopper tiles run (docs/matmul_cuda.md).
//
// Build and run on the GPU:
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I cuda tools/experiments/mma_zero_step.cu -o z && ./z
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "common/mma_sm80.cuh"
#include "cuda_check.h"

// Each thread of each warp: one mma with zero operands on four accumulators from `c` (a warp's
// 128 consecutive words), the results into `d`.
template <bool kBf16>
__global__ void zero_step(const uint32_t* c, uint32_t* d, int n) {
  const int base = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (base >= n) return;  // whole warps only (n is a multiple of 128 words): the mma needs all 32 lanes
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = __uint_as_float(c[base + i]);
  const uint32_t a[4] = {0u, 0u, 0u, 0u};
  jaxdet::mma_m16n8k16<kBf16>(acc, a, 0u, 0u);
  for (int i = 0; i < 4; ++i) d[base + i] = __float_as_uint(acc[i]);
}

int main() {
  std::vector<uint32_t> c;
  for (uint32_t m = 1; m < (1u << 23); m += 997) c.push_back(m);                // positive subnormals
  for (uint32_t m = 1; m < (1u << 23); m += 997) c.push_back(0x80000000u | m);  // negative subnormals
  for (uint32_t b = 0; b < 23; ++b) c.push_back(1u << b), c.push_back(0x80000000u | (1u << b));
  for (uint32_t e = 1; e < 255; ++e) {
    c.push_back((e << 23) | 0x1234u);
    c.push_back(0x80000000u | (e << 23) | 0x7FFFFFu);
  }
  for (uint32_t v : {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0x7FC00001u, 0x7F800001u,
                     0xFFC12345u, 0x7FFFFFFFu, 0x00800000u, 0x007FFFFFu, 0x807FFFFFu}) {
    c.push_back(v);
  }
  while (c.size() % 128) c.push_back(0u);
  const int n = static_cast<int>(c.size());
  uint32_t *dc = nullptr, *dd = nullptr;
  CHECK(cudaMalloc(&dc, n * 4));
  CHECK(cudaMalloc(&dd, n * 4));
  CHECK(cudaMemcpy(dc, c.data(), n * 4, cudaMemcpyHostToDevice));
  for (bool bf16 : {true, false}) {
    const int threads = n / 4;
    if (bf16) {
      zero_step<true><<<(threads + 127) / 128, 128>>>(dc, dd, n);
    } else {
      zero_step<false><<<(threads + 127) / 128, 128>>>(dc, dd, n);
    }
    CHECK(cudaGetLastError());
    std::vector<uint32_t> d(n);
    CHECK(cudaMemcpy(d.data(), dd, n * 4, cudaMemcpyDeviceToHost));
    int changed = 0, neg_zero = 0, sub = 0, nan = 0;
    for (int i = 0; i < n; ++i) {
      if (d[i] == c[i]) continue;
      if (c[i] == 0x80000000u && d[i] == 0u) {
        ++neg_zero;
        continue;
      }
      if (changed < 12) std::printf("  C %08x -> D %08x\n", c[i], d[i]);
      ++changed;
      if ((c[i] & 0x7F800000u) == 0) ++sub;
      if ((c[i] & 0x7F800000u) == 0x7F800000u && (c[i] & 0x7FFFFFu)) ++nan;
    }
    std::printf("%s operands: %d accumulators; -0 -> +0: %d; other changes: %d (subnormal C: %d, NaN C: %d)\n",
                bf16 ? "bf16" : "f16", n, neg_zero, changed, sub, nan);
  }
  return 0;
}
