// Time of the forward's narrow tiles (cuda/gemm/gemm_narrow.cuh) by pipeline depth and width, and
// of the kernel they replaced (64-bit address arithmetic for every copy of every K tile, and each
// k16 step waiting on its own shared-memory reads; kept here as `before`), side by side in one
// process, with the bits of each against `before` (a depth decides how many K tiles are in flight
// and a width which CTA computes a column, never what a K step computes). The GEMM against
// jnp.dot: benchmarks/matmul_bench.py.
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

namespace before {
using namespace jaxdet;
using namespace jaxdet::gemm;
using namespace jaxdet::gemm::narrow;
constexpr int kThreads = 128;
constexpr int kTileN = 32;
constexpr int kATileBytes = kTileM * kTileK * 2;
constexpr int kStageBytes = kATileBytes + 32 * kTileK * 2;
template <class ElementD>
__device__ __forceinline__ void store_d(ElementD* p, float alpha, float beta, float acc) {
  store_root(p, fmaf(beta, 0.0f, alpha * acc));
}
__device__ __forceinline__ int n_major_offset(int k, int chunk) {
  return k * 64 + ((chunk ^ ((k >> 1) & 3)) << 4);
}
template <class Element, class ElementD, int kStages>
__global__ void __launch_bounds__(kThreads) narrow_gemm_kernel(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n0 = int64_t{blockIdx.x} * kTileN;
  const int64_t m_blocks = p.m_blocks;
  const int k_tiles = p.k_tiles;
  const int warp_n = 16 * (warp & 1), warp_m = 8 * (warp >> 1);

  const int64_t units = p.l * p.chunks;  // (batch, chunk) pairs, chunk fastest
  for (int64_t lc = blockIdx.z; lc < units; lc += gridDim.z) {
    const int64_t l = lc / p.chunks;
    const int c = static_cast<int>(lc - l * p.chunks);
    const int kt_begin = c * p.chunk_k_tiles;  // this chunk's K tiles: [kt_begin, kt_begin + nkt)
    const int nkt = (k_tiles - kt_begin < p.chunk_k_tiles ? k_tiles - kt_begin : p.chunk_k_tiles);
    for (int64_t mb = blockIdx.y; mb < m_blocks; mb += gridDim.y) {
      const int64_t m0 = mb * kTileM;
      const int rows = static_cast<int>(p.m - m0 < kTileM ? p.m - m0 : kTileM);
      const char* a = p.a + 2 * (l * p.batch_a + m0 * p.lda);
      const char* b = p.b + 2 * (l * p.batch_b);

      // Stage s <- K tile kt; chunks past M, N or K are zeros (the ones TMA fills in).
      auto load = [&](int s, int kt) {
        unsigned char* stage = smem + s * kStageBytes;
        const int64_t k0 = int64_t{kt} * kTileK;
        {
          const int row = tid >> 3, chunk = tid & 7;
          const int64_t k = k0 + 8 * chunk;
          if (row < 8 || rows > 8) {  // rows 8..15 are read only when the block has them
            const bool valid = row < rows && k < p.k;
            cp_async16(stage + k_major_offset(row, chunk), valid ? a + 2 * (row * p.lda + k) : p.a, valid);
          }
        }
        unsigned char* b_stage = stage + kATileBytes;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int i = tid + j * kThreads;
          const int row = i >> 2, chunk = i & 3;  // row: k; chunk: 8 n
          const int64_t k = k0 + row, n = n0 + 8 * chunk;
          const bool valid = k < p.k && n < p.n;
          cp_async16(b_stage + n_major_offset(row, chunk), valid ? b + 2 * (k * p.ldb + n) : p.b, valid);
        }
      };

#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        if (s < nkt) load(s, kt_begin + s);
        cp_async_commit();
      }

      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const bool active = warp_m < rows;
      const int r8 = lane & 7, mat = lane >> 3;
      for (int kt = 0; kt < nkt; ++kt) {  // kt: the chunk's K tiles, from its first
        cp_async_wait<kStages - 2>();
        __syncthreads();  // K tile kt is in; every warp is done with the stage loaded next
        if (kt + kStages - 1 < nkt) load((kt + kStages - 1) % kStages, kt_begin + kt + kStages - 1);
        cp_async_commit();
        if (!active) continue;
        const unsigned char* stage = smem + (kt % kStages) * kStageBytes;
        const unsigned char* b_stage = stage + kATileBytes;
#pragma unroll
        for (int ks = 0; ks < kTileK / 16; ++ks) {
          uint32_t bt[4];  // B^T rows warp_n..+15 (the mma's A operand), k 16ks..+15, transposed from B's rows
          ldsm_x4_trans(bt, b_stage + n_major_offset(16 * ks + 8 * (mat >> 1) + r8, warp_n / 8 + (mat & 1)));
          uint32_t at[2];  // A^T: k 16ks..+15 by rows warp_m..+7 (the mma's B operand)
          ldsm_x2(at, stage + k_major_offset(warp_m + r8, 2 * ks + (mat & 1)));
          mma_m16n8k16<std::is_same_v<Element, cutlass::bfloat16_t>>(acc, bt, at[0], at[1]);
        }
      }
      cp_async_wait<0>();

      // acc[i]: D^T row n = warp_n + lane / 4 (+ 8 for i >= 2), column m = warp_m + 2 (lane % 4) + (i & 1).
      ElementD* d = static_cast<ElementD*>(p.d) + l * p.batch_d;
      if (p.chunks == 1) {
        if (active) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t n = n0 + warp_n + (lane >> 2) + 8 * (i >> 1);
            const int mi = warp_m + 2 * (lane & 3) + (i & 1);
            if (mi < rows && n < p.n) store_d(d + (m0 + mi) * p.ldd + n, p.alpha, p.beta, acc[i]);
          }
        }
      } else {
        // The partial as a float32 D holds it (beta * 0 + alpha * acc: an accumulator of -0 is +0).
        const int64_t tile = (l * m_blocks + mb) * p.n_tiles + blockIdx.x;
        const int64_t chunk_stride = m_blocks * p.n_tiles * kThreads;  // float4s from chunk c to c + 1
        float4* part = reinterpret_cast<float4*>(p.partials) +
                       ((l * p.chunks * m_blocks + mb) * p.n_tiles + blockIdx.x) * kThreads + tid;
        __stcg(part + c * chunk_stride,
               make_float4(fmaf(p.beta, 0.0f, p.alpha * acc[0]), fmaf(p.beta, 0.0f, p.alpha * acc[1]),
                           fmaf(p.beta, 0.0f, p.alpha * acc[2]), fmaf(p.beta, 0.0f, p.alpha * acc[3])));
        __threadfence();  // the partial is visible before this CTA's arrival is counted
        __syncthreads();
        __shared__ int combine;
        if (tid == 0) combine = atomicAdd(p.counters + tile, 1) == p.chunks - 1;
        __syncthreads();
        if (combine) {
          __threadfence();  // every other chunk's partial, counted before ours, is visible
          if (active) {
            const float4 r = detmath::tree_fold<float4>(
                p.chunks, [&](int64_t cc) { return __ldcg(part + cc * chunk_stride); },
                [](float4 x, float4 y) {
                  return make_float4(detmath::add(x.x, y.x), detmath::add(x.y, y.y), detmath::add(x.z, y.z),
                                     detmath::add(x.w, y.w));
                });
            const float root[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const int64_t n = n0 + warp_n + (lane >> 2) + 8 * (i >> 1);
              const int mi = warp_m + 2 * (lane & 3) + (i & 1);
              if (mi < rows && n < p.n) store_root(d + (m0 + mi) * p.ldd + n, root[i]);
            }
          }
        }
      }
      __syncthreads();  // the next work item's prologue overwrites the stages
    }
  }
}

}  // namespace before

// Launches cycle through copies of B (together larger than L2), so each reads B from memory.
// Width 0: the kernel before (16x32).
template <int TileN, int Stages>
float time_us(const std::vector<jaxdet::gemm::GemmArgs>& gs, int reps) {
  const auto kernel = TileN == 0 ? before::narrow_gemm_kernel<Element, Element, Stages>
                                 : narrow::narrow_gemm_kernel < Element,
             Element, TileN == 0 ? 32 : TileN, Stages > ;
  constexpr int smem = narrow::kSmemBytes < TileN == 0 ? 32 : TileN, Stages > ;
  constexpr int threads = narrow::Tile < TileN == 0 ? 32 : TileN > ::kThreads;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::vector<narrow::Params> ps;
  for (const auto& g : gs) ps.push_back(narrow::make_params<TileN == 0 ? 32 : TileN>(g));
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

// K beyond one chunk (8192): each CTA folding its tile's chunks ("walked") against a CTA per chunk
// and tile ("split"), both through the launcher (its rule forced by the SM count it is told), and
// one pass over K without chunks (other bits: not the chunk tree).
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
    const auto with = [&](int64_t chunk, int sm_count) {
      auto v = gs;
      for (auto& e : v) e.chunk = chunk, e.sm_count = sm_count;
      return v;
    };
    const auto cleared = [&] { CHECK(cudaMemset(dd, 0xff, 16 * int64_t{N} * 2)); };
    cleared();
    const float one_pass = time_launch_us<TileN>(with(0, 0), 200);
    cleared();
    const float walked = time_launch_us<TileN>(with(8192, 0), 200);
    const auto walked_bits = bits_of(gs[0]);
    cleared();
    const float split = time_launch_us<TileN>(with(8192, 1 << 30), 200);
    std::printf("| %d | %d | %d | 16x%d | %.1f | %.1f | %.1f | %s |\n", K, N, M, TileN, one_pass, walked, split,
                bits_of(gs[0]) == walked_bits ? "equal" : "DIFFER");
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
      "| K | N | M | before (16x32, 8 stages) us | 16x32, 4 stages | 6 | 8 | 12 | 16x16, 8 | 12 | 16 | HBM GB/s: "
      "before | "
      "best | bits vs before |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
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
      float t[8];
      cleared();
      t[0] = time_us<0, 8>(gs, reps);
      const auto ref = bits_of(g);
      int differ = 0;
      const auto check = [&] {
        differ += bits_of(g) != ref;
        cleared();
      };
      cleared();
      t[1] = time_us<32, 4>(gs, reps);
      check();
      t[2] = time_us<32, 6>(gs, reps);
      check();
      t[3] = time_us<32, 8>(gs, reps);
      check();
      t[4] = time_us<32, 12>(gs, reps);
      check();
      t[5] = time_us<16, 8>(gs, reps);
      check();
      t[6] = time_us<16, 12>(gs, reps);
      check();
      t[7] = time_us<16, 16>(gs, reps);
      check();
      float best = t[1];
      for (int i = 2; i < 8; ++i) best = t[i] < best ? t[i] : best;
      const double bytes = 2.0 * (double(K) * N + double(M) * K + double(M) * N);
      std::printf("| %d | %d | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %s |\n",
                  K, N, M, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], bytes / (t[0] * 1e3),
                  bytes / (best * 1e3), differ ? "DIFFER" : "equal");
    }
    CHECK(cudaFree(da));
    CHECK(cudaFree(db));
    CHECK(cudaFree(dd));
  }

  std::printf(
      "\n| K | N | M | tile | one pass, no chunks us | chunks walked | chunks split | bits walked vs split "
      "|\n|---|---|---|---|---|---|---|---|\n");
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
