// How fast the GPU reads a batch-1 decode step's KV cache in the pattern attention's split-mode
// kernels read it, against the same bytes read in contiguous pieces, so that a change to the
// decode kernels can tell a bound of the access pattern from one of the kernel (Step 8; the
// decode kernels themselves are timed by benchmarks/attention_bench.py).
//
// The cache is K and V of [S = 4096 positions, H = 8 KV heads, D = 128] bfloat16 (8 MiB each), as
// `jaxdet.attention` receives it. A "split" CTA owns positions [z R, (z + 1) R) of one head: its
// rows are 256 bytes, H * 256 bytes apart (DecodeSplitKernel: R = 512, 64 CTAs; two CTAs per split,
// as DecodePairKernel ran: the same bytes over 128 CTAs). A "contiguous" CTA reads as many bytes
// of K and of V in one piece. Each CTA copies with 16-byte cp.async into shared memory, in one
// phase (K and V at once) or two (K, then V into the same place), as the kernels do. Eight copies
// of the cache are rotated so that every launch reads from HBM (L2 holds 50 MB).
//
// Build and run on a GPU (tools/gpu_session.sh decode-read):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I cuda tools/experiments/decode_read_pattern.cu -o drp
//   ./drp
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "common/mma_sm80.cuh"
#include "cuda_check.h"

namespace {

constexpr int kS = 4096, kH = 8, kD = 128, kRowBytes = kD * 2, kCopies = 8, kThreads = 256;
constexpr int64_t kTensorBytes = int64_t{kS} * kH * kRowBytes;

using jaxdet::cp_async16;  // the kernels' copy instruction

__device__ __forceinline__ void cp_async_wait_all() {
  jaxdet::cp_async_commit();
  jaxdet::cp_async_wait<0>();
}

// `bytes` of `base` from `first` into shared memory at `dst`: in 256-byte rows `stride` bytes
// apart (a split's rows of one head), or in one piece (stride == kRowBytes).
__device__ __forceinline__ void copy_rows(unsigned char* dst, const unsigned char* base, int64_t first, int rows,
                                          int64_t stride) {
  constexpr int kChunks = kRowBytes / 16;
  for (int i = threadIdx.x; i < rows * kChunks; i += kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    cp_async16(dst + row * kRowBytes + chunk * 16, base + first + row * stride + chunk * 16, true);
  }
}

// CTA c reads `rows` rows of K and of V: split pattern (c = z * kH + h) or contiguous.
__global__ void ReadKernel(const unsigned char* k, const unsigned char* v, int rows, bool split, bool one_phase,
                           float* sink) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int c = blockIdx.x;
  int64_t first, stride;
  if (split) {
    const int z = c / kH, h = c % kH;
    first = (int64_t{z} * rows * kH + h) * kRowBytes;
    stride = int64_t{kH} * kRowBytes;
  } else {
    first = int64_t{c} * rows * kRowBytes;
    stride = kRowBytes;
  }
  const int64_t half = int64_t{rows} * kRowBytes;
  float acc = 0.0f;
  copy_rows(smem, k, first, rows, stride);
  if (one_phase) {
    copy_rows(smem + half, v, first, rows, stride);
    cp_async_wait_all();
    __syncthreads();
    acc += static_cast<float>(smem[threadIdx.x]) + static_cast<float>(smem[half + threadIdx.x]);
  } else {
    cp_async_wait_all();
    __syncthreads();
    acc += static_cast<float>(smem[threadIdx.x]);
    __syncthreads();
    copy_rows(smem, v, first, rows, stride);
    cp_async_wait_all();
    __syncthreads();
    acc += static_cast<float>(smem[threadIdx.x]);
  }
  if (acc == -1.0f) sink[c] = acc;  // never true: keeps the copies
}

// Every SM, plain 16-byte loads: what a kernel that only reads gets from the same 16 MiB.
__global__ void StreamKernel(const uint4* k, const uint4* v, int64_t n, float* sink) {
  uint32_t x = 0;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const uint4 a = k[i], b = v[i];
    x ^= a.x ^ a.w ^ b.y ^ b.z;
  }
  if (x == 0x12345678u) sink[0] = static_cast<float>(x);
}

// Microseconds per launch of launch(copy) over kReps launches back to back, copy rotating over the
// kCopies caches (after three launches that are not timed).
template <class Launch>
double time_launches(Launch launch) {
  constexpr int kReps = 200;
  for (int r = 0; r < 3; ++r) launch(0);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start));
  for (int r = 0; r < kReps; ++r) launch((r % kCopies) * kTensorBytes);
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  CHECK(cudaGetLastError());
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return 1e3 * ms / kReps;
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  unsigned char *k = nullptr, *v = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&k, kTensorBytes * kCopies));
  CHECK(cudaMalloc(&v, kTensorBytes * kCopies));
  CHECK(cudaMalloc(&sink, 4096 * sizeof(float)));
  CHECK(cudaMemset(k, 1, kTensorBytes * kCopies));
  CHECK(cudaMemset(v, 2, kTensorBytes * kCopies));
  CHECK(cudaFuncSetAttribute(ReadKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 2 * 256 * kRowBytes));
  const double bytes = 2.0 * kTensorBytes;
  std::printf("| pattern | rows per CTA | CTAs | phases | µs per launch | TB/s |\n|---|---|---|---|---|---|\n");
  struct Case {
    bool split;
    int rows;
    bool one_phase;
  };
  const Case cases[] = {{true, 512, false},  {true, 256, false}, {true, 256, true}, {false, 512, false},
                        {false, 256, false}, {false, 256, true}, {true, 128, true}, {false, 128, true}};
  for (int round = 0; round < 2; ++round) {
    for (const Case& cs : cases) {
      const int ctas = kS / cs.rows * kH;
      const size_t smem = static_cast<size_t>(cs.rows) * kRowBytes * (cs.one_phase ? 2 : 1);
      const double us = time_launches([&](int64_t at) {
        ReadKernel<<<ctas, kThreads, smem>>>(k + at, v + at, cs.rows, cs.split, cs.one_phase, sink);
      });
      std::printf("| %s | %d | %d | %d | %.2f | %.2f |\n", cs.split ? "split (one head's rows)" : "contiguous",
                  cs.rows, ctas, cs.one_phase ? 1 : 2, us, bytes / us * 1e-6);
    }
    const double us = time_launches([&](int64_t at) {
      StreamKernel<<<sms * 4, 512>>>(reinterpret_cast<const uint4*>(k + at),
                                     reinterpret_cast<const uint4*>(v + at), kTensorBytes / 16, sink);
    });
    std::printf("| every SM, plain loads | - | %d | 1 | %.2f | %.2f |\n", sms * 4, us, bytes / us * 1e-6);
  }
  return 0;
}
