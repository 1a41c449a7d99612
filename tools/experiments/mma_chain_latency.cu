// Clocks per dependent k16 step of the two tensor-core instruction families on one SM (Hopper):
// wgmma.mma_async m64nNk16 (one warpgroup; BATCH instructions per commit/wait, as a GEMM
// mainloop issues a K tile's steps) and mma.sync m16n8k16 (one warp), each step adding into the
// previous one's float32 accumulator. Operands are zeros in shared memory / registers: only the
// timing matters. Used to bound what a GEMM at small M could gain from a different instruction
// (docs/matmul_cuda.md, "M buckets"); the GEMM itself is measured by benchmarks/matmul_bench.py.
//
// Build and run on a Hopper GPU (tools/gpu_session.sh mma-latency):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a tools/experiments/mma_chain_latency.cu -o cl
//   ./cl
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

// One wgmma m64nNk16 (bf16 in, f32 accumulators d: N/2 per thread) adding into d.
template <int N>
__device__ __forceinline__ void wgmma_step(float* d, uint64_t da, uint64_t db);

template <>
__device__ __forceinline__ void wgmma_step<8>(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(da), "l"(db));
}

template <>
__device__ __forceinline__ void wgmma_step<64>(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%"
      "28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db));
}

template <>
__device__ __forceinline__ void wgmma_step<128>(float* d, uint64_t da, uint64_t db) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%"
      "28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%"
      "54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]),
        "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]),
        "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]),
        "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),
        "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db));
}

// BATCH dependent steps, then one commit and wait, as a mainloop issues one K tile.
template <int N, int BATCH>
__device__ __forceinline__ void wgmma_batch(float* d, uint64_t da, uint64_t db) {
#pragma unroll
  for (int b = 0; b < BATCH; ++b) wgmma_step<N>(d, da, db);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

__device__ __forceinline__ uint64_t desc(const void* p) {
  uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  uint64_t d = 0;
  d |= (uint64_t)((a & 0x3FFFF) >> 4);
  d |= (uint64_t)(128 >> 4) << 16;   // LBO
  d |= (uint64_t)(256 >> 4) << 32;   // SBO
  return d;  // no swizzle
}

template <int N, int BATCH>
__global__ void wg_kernel(long long* out, int iters) {
  __shared__ __align__(1024) unsigned short smem[16384];
  for (int i = threadIdx.x; i < 16384; i += blockDim.x) smem[i] = 0;
  __syncthreads();
  float d[N / 2];
  for (int i = 0; i < N / 2; ++i) d[i] = 0.f;
  uint64_t da = desc(smem), db = desc(smem + 8192);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    wgmma_batch<N, BATCH>(d, da, db);
  }
  long long t1 = clock64();
  float s = 0;
  for (int i = 0; i < N / 2; ++i) s += d[i];
  if (threadIdx.x == 0) {
    out[0] = t1 - t0;
    out[1] = (long long)s;
  }
}

template <int CHAIN>
__global__ void mma_kernel(long long* out, int iters) {
  float d0 = 0, d1 = 0, d2 = 0, d3 = 0;
  unsigned a0 = threadIdx.x, a1 = 0, a2 = 0, a3 = 0, b0 = 0, b1 = 0;
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int c = 0; c < CHAIN; ++c)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
  long long t1 = clock64();
  if (threadIdx.x == 0) {
    out[0] = t1 - t0;
    out[1] = (long long)(d0 + d1 + d2 + d3);
  }
}

template <class K>
void run(const char* name, K kernel, int threads, int steps_per_iter) {
  long long* out;
  cudaMalloc(&out, 16);
  int iters = 2000;
  kernel<<<1, threads>>>(out, 10);
  kernel<<<1, threads>>>(out, iters);
  long long h[2];
  cudaMemcpy(h, out, 16, cudaMemcpyDeviceToHost);
  cudaError_t e = cudaGetLastError();
  printf("%-28s %8.1f clocks per dependent k16 step  (%s)\n", name,
         double(h[0]) / (double(iters) * steps_per_iter), cudaGetErrorString(e));
  cudaFree(out);
}

int main() {
  run("wgmma m64n8k16  batch 1", wg_kernel<8, 1>, 128, 1);
  run("wgmma m64n8k16  batch 4", wg_kernel<8, 4>, 128, 4);
  run("wgmma m64n64k16 batch 1", wg_kernel<64, 1>, 128, 1);
  run("wgmma m64n64k16 batch 4", wg_kernel<64, 4>, 128, 4);
  run("wgmma m64n64k16 batch 16", wg_kernel<64, 16>, 128, 16);
  run("wgmma m64n128k16 batch 4", wg_kernel<128, 4>, 128, 4);
  run("wgmma m64n128k16 batch 16", wg_kernel<128, 16>, 128, 16);
  run("mma.sync m16n8k16 chain 1", mma_kernel<1>, 32, 1);
  run("mma.sync m16n8k16 chain 8", mma_kernel<8>, 32, 8);
  return 0;
}
