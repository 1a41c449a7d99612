// A warp-specialized form of the forward's narrow GEMM tiles (cuda/gemm/gemm_narrow.cuh), timed
// and bit-compared against the package's kernel in one process. At M <= 16 the package's kernel
// runs one CTA per SM, so its compute warps also issue every copy and meet at a barrier per K
// tile; here one producer warp issues the copies (cp.async, completion tracked by an mbarrier per
// stage) and the compute warps only wait for a stage, read it and run the MMA chain, releasing the
// stage through a second mbarrier. The compute warps' k16 steps are the package's (same operands,
// same order), so the bits must be equal. One chunk of K (no chunk tree), B stored [K, N].
//
// Build and run on a Hopper GPU (tools/gpu_session.sh narrow-ws):
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I cuda -I <cutlass>/include \
//     tools/experiments/gemm_narrow_ws.cu -o ws && ./ws
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"
#include "gemm/gemm_narrow.cuh"
#include "narrow_probe.h"

namespace narrow = jaxdet::gemm::narrow;
using Element = cutlass::bfloat16_t;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// The barrier's arrival once every cp.async this thread issued before it has landed.
__device__ __forceinline__ void mbar_arrive_on_copies(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

template <int TileN, int kStages>
struct Ws {
  using T = narrow::Tile<TileN>;
  static constexpr int kComputeWarps = T::kWarps;
  static constexpr int kThreads = T::kThreads + 32;  // and one producer warp
  static constexpr int kSmemBytes = kStages * T::kStageBytes;
};

template <int TileN, int kStages>
__global__ void __launch_bounds__(Ws<TileN, kStages>::kThreads) ws_kernel(const narrow::Params p) {
  using T = narrow::Tile<TileN>;
  using W = Ws<TileN, kStages>;
  constexpr int kTileK = narrow::kTileK, kTileM = narrow::kTileM;
  constexpr int kStageBytes = T::kStageBytes, kATileBytes = T::kATileBytes;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ uint64_t full[kStages], empty[kStages];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool producer = warp == W::kComputeWarps;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 32);                  // the producer's lanes, each once its copies land
      mbar_init(&empty[s], W::kComputeWarps);  // each compute warp, once it has read the stage
    }
  }
  __syncthreads();
  const int64_t n0 = int64_t{blockIdx.x} * TileN;
  const int nkt = p.k_tiles;
  int64_t g = 0;  // K tiles this CTA has passed through the stages, over its work items
  for (int64_t l = blockIdx.z; l < p.l; l += gridDim.z) {
    for (int64_t mb = blockIdx.y; mb < p.m_blocks; mb += gridDim.y) {
      const int64_t m0 = mb * kTileM;
      const int rows = static_cast<int>(p.m - m0 < kTileM ? p.m - m0 : kTileM);
      if (producer) {
        const char* a = p.a + 2 * (l * p.batch_a + m0 * p.lda);
        const char* b = p.b + 2 * (l * p.batch_b);
        // Each lane's copies: fixed shared-memory offsets, source pointers that advance by one K
        // tile, zeros past M, N or K (as in the package's kernel).
        constexpr int kA = kATileBytes / 16 / 32, kB = T::kBTileBytes / 16 / 32;  // chunks per lane
        const char* a_src[kA];
        int a_dst[kA], a_k[kA];
        bool a_live[kA], a_issued[kA];
#pragma unroll
        for (int j = 0; j < kA; ++j) {
          const int i = lane + 32 * j, row = i >> 3, chunk = i & 7;
          a_src[j] = a + 2 * (row * p.lda + 8 * chunk);
          a_dst[j] = narrow::k_major_offset(row, chunk);
          a_k[j] = 8 * chunk;
          a_live[j] = row < rows;
          a_issued[j] = row < 8 || rows > 8;
        }
        const char* b_src[kB];
        int b_dst[kB], b_k[kB];
        bool b_live[kB];
#pragma unroll
        for (int j = 0; j < kB; ++j) {
          const unsigned i = lane + 32 * j;
          const int row = static_cast<int>(i / (TileN / 8)), chunk = static_cast<int>(i % (TileN / 8));
          b_src[j] = b + 2 * (row * p.ldb + n0 + 8 * chunk);
          b_dst[j] = kATileBytes + T::b_offset(row, chunk);
          b_k[j] = row;
          b_live[j] = n0 + 8 * chunk < p.n;
        }
        const int64_t b_step = 2 * kTileK * p.ldb;
        int k_left = static_cast<int>(p.k);
        for (int t = 0; t < nkt; ++t, ++g) {
          const int s = static_cast<int>(g % kStages);
          if (g >= kStages) mbar_wait(&empty[s], static_cast<uint32_t>((g / kStages - 1) & 1));
          unsigned char* stage = smem + s * kStageBytes;
#pragma unroll
          for (int j = 0; j < kA; ++j) {
            const bool valid = a_live[j] && a_k[j] < k_left;
            if (a_issued[j]) jaxdet::cp_async16(stage + a_dst[j], valid ? a_src[j] : p.a, valid);
            a_src[j] += 2 * kTileK;
          }
#pragma unroll
          for (int j = 0; j < kB; ++j) {
            const bool valid = b_live[j] && b_k[j] < k_left;
            jaxdet::cp_async16(stage + b_dst[j], valid ? b_src[j] : p.b, valid);
            b_src[j] += b_step;
          }
          k_left -= kTileK;
          mbar_arrive_on_copies(&full[s]);
        }
      } else {
        const int warp_n = 16 * static_cast<int>(unsigned(warp) % T::kColumnWarps);
        const int warp_m = 8 * static_cast<int>(unsigned(warp) / T::kColumnWarps);
        const bool active = warp_m < rows;
        const int r8 = lane & 7, mat = lane >> 3;
        struct Operands {
          uint32_t bt[kTileK / 16][4];
          uint32_t at[kTileK / 16][2];
        };
        auto read = [&](Operands& o, int s, int ks) {  // k16 step ks of stage s
          const unsigned char* stage = smem + s * kStageBytes;
          jaxdet::ldsm_x4_trans(
              o.bt[ks], stage + kATileBytes + T::b_offset(16 * ks + 8 * (mat >> 1) + r8, warp_n / 8 + (mat & 1)));
          jaxdet::ldsm_x2(o.at[ks], stage + narrow::k_major_offset(warp_m + r8, 2 * ks + (mat & 1)));
        };
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        auto step = [&](const Operands& o, int ks) {
          jaxdet::mma_m16n8k16<true>(acc, o.bt[ks], o.at[ks][0], o.at[ks][1]);
        };
        // Stage s of K tile gt: in, then (after this warp's reads) released. Every compute warp
        // waits and releases each tile, active or not, so that no warp runs a phase ahead.
        auto wait_full = [&](int64_t gt) {
          const int s = static_cast<int>(gt % kStages);
          mbar_wait(&full[s], static_cast<uint32_t>((gt / kStages) & 1));
          return s;
        };
        auto release = [&](int s) {
          __syncwarp();
          if (lane == 0) mbar_arrive(&empty[s]);
        };
        // K tile t's steps with tile t + 1's wait and reads between them: the MMA chain stays
        // the only serial path.
        auto iteration = [&](const Operands& cur, Operands& next, int64_t gt_next, bool more) {
          if (active) step(cur, 0);
          const int s = more ? wait_full(gt_next) : 0;
          if (active) step(cur, 1);
          if (more && active) read(next, s, 0), read(next, s, 1);
          if (active) step(cur, 2);
          if (more && active) read(next, s, 2), read(next, s, 3);
          if (active) step(cur, 3);
          if (more) release(s);
        };
        Operands o0, o1;  // named, not indexed: registers
        if (nkt > 0) {
          const int s = wait_full(g);
          if (active) {
#pragma unroll
            for (int ks = 0; ks < kTileK / 16; ++ks) read(o0, s, ks);
          }
          release(s);
        }
        int t = 0;
        for (; t + 1 < nkt; t += 2) {
          iteration(o0, o1, g + t + 1, true);
          iteration(o1, o0, g + t + 2, t + 2 < nkt);
        }
        if (t < nkt) iteration(o0, o1, g + t + 1, false);
        g += nkt;
        if (active) {
          auto* d = static_cast<__nv_bfloat16*>(p.d) + l * p.batch_d;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int64_t n = n0 + warp_n + (lane >> 2) + 8 * (i >> 1);
            const int mi = warp_m + 2 * (lane & 3) + (i & 1);
            if (mi < rows && n < p.n)
              d[(m0 + mi) * p.ldd + n] = __float2bfloat16_rn(fmaf(p.beta, 0.0f, p.alpha * acc[i]));
          }
        }
      }
    }
  }
  if (producer) jaxdet::cp_async_wait<0>();  // no thread leaves with copies in flight
}

// The warp-specialized kernel on gs in turn.
template <int TileN, int Stages>
float time_ws_us(const std::vector<jaxdet::gemm::GemmArgs>& gs, int reps) {
  using W = Ws<TileN, Stages>;
  const auto kernel = ws_kernel<TileN, Stages>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, W::kSmemBytes));
  std::vector<narrow::Params> ps;
  for (const auto& g : gs) ps.push_back(narrow::make_params<TileN>(g));
  const dim3 grid = narrow::grid_of(ps[0]);
  return narrow_probe::time_us([&](int i) { kernel<<<grid, W::kThreads, W::kSmemBytes>>>(ps[i % ps.size()]); },
                               reps);
}

template <int TileN>
void compare(int K, int N) {
  using narrow_probe::bits_of;
  const narrow_probe::Operands ops(N, narrow_probe::random_bf16(16 * int64_t{K}, 2468),
                                  narrow_probe::random_bf16(int64_t{K} * N, 1357));
  for (int M : {1, 4, 9, 16}) {
    const auto gs = ops.args(M, K, N);
    ops.clear_d();
    const float package = narrow_probe::time_kernel_us<TileN, 8>(gs, 200);
    const auto ref = bits_of(gs[0]);
    int differ = 0;
    float t[3];
    ops.clear_d();
    t[0] = time_ws_us<TileN, 4>(gs, 200);
    differ += bits_of(gs[0]) != ref;
    ops.clear_d();
    t[1] = time_ws_us<TileN, 8>(gs, 200);
    differ += bits_of(gs[0]) != ref;
    ops.clear_d();
    t[2] = time_ws_us<TileN, 12>(gs, 200);
    differ += bits_of(gs[0]) != ref;
    const double bytes = 2.0 * (double(K) * N + double(M) * K + double(M) * N);
    float best = t[0] < t[1] ? t[0] : t[1];
    best = t[2] < best ? t[2] : best;
    std::printf("| %d | %d | %d | 16x%d | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %s |\n", K, N, M, TileN,
                package, t[0], t[1], t[2], bytes / (package * 1e3), bytes / (best * 1e3),
                differ ? "DIFFER" : "equal");
  }
}

int main() {
  std::printf(
      "| K | N | M | tile | package, 8 stages us | warp-specialized, 4 | 8 | 12 | HBM GB/s: package | best | bits "
      "|\n|---|---|---|---|---|---|---|---|---|---|---|\n");
  // A d-2048 model's decode products (q|k|v, o, down, gate|up, head; the wide ones also with the
  // 16x64 narrow tile) and the benchmark's (4096, 4096), (14336, 4096).
  compare<32>(2048, 4096);
  compare<16>(2048, 2048);
  compare<16>(5632, 2048);
  compare<32>(2048, 11264);
  compare<64>(2048, 11264);
  compare<64>(2048, 32000);
  compare<32>(4096, 4096);
  compare<32>(14336, 4096);
  return 0;
}
