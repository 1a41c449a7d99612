// The Hopper (sm_90a) tensor-core core of jaxdet.attention's forward: warpgroup MMAs (wgmma
// m64nNk16, float32 accumulation) in place of mma.sync for the scores and the P.V product.
// Included by attention_mma.cuh, whose forward kernel runs either core.
//
// Why the bits are those of the mma.sync core (MmaSyncCore): a warpgroup's m64nNk16 is four
// warps' m16nNk16 with the mma.sync fragment layouts (A registers, for P.V: row grp / grp + 8,
// columns 2 q4 + {0, 1} and + 8; accumulators d[4 nt + i] at row grp + 8 (i >> 1), column 8 nt +
// 2 q4 + (i & 1)), so every lane holds the same score and output elements as under mma.sync and the
// softmax code that follows runs unchanged. Each element is the same chain of k16 steps into a
// float32 accumulator that starts at +0 (scale-d 1 on registers holding +0, as mma.sync adds its
// zeroed C), in the same ascending order: scores over the head dimension, P.V over the block's
// keys. On the H100 a chain of k16 steps gives the same bits through wgmma and mma.sync (the
// GEMM's two kernel families, docs/matmul_cuda.md); the GPU test
// test_wgmma_forward_equals_the_mma_sync_forward compares the two cores over special values.
//
// Shared-memory tiles of Q, K and V: 64 rows of D elements in 128-byte-swizzled atoms of
// 8 rows x 64 elements (the 16-byte chunk c of row n at chunk c ^ (n % 8)), the 64-element
// column halves one after the other (8 KB apart). Q and K are K-major for the scores (A = Q and
// B = K^T: stride 1024 bytes between 8-row groups); V is MN-major for P.V (B = V: 1024 bytes
// between 8-key groups along K, 8 KB between 64-element halves along N).
#pragma once

#include <string>
#include <type_traits>

#include "common/testing.h"

namespace jaxdet {
namespace attn {
namespace {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXDET_ATTENTION_WGMMA 1
#endif

// A wgmma shared-memory matrix descriptor for a 128-byte-swizzled tile (PTX ISA, "Matrix
// Descriptor Format"): start address, leading and stride byte offsets (16-byte units), layout
// type 1 (128-byte swizzle) in bits 62-63. The tile bases are 1024-byte aligned (base offset 0).
__device__ __forceinline__ uint64_t sw128_desc(const void* smem, uint32_t leading_bytes, uint32_t stride_bytes) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16 |
         static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32 | uint64_t{1} << 62;
}

// The descriptor of the same tile `bytes` (a multiple of 16) further on: the start address is the
// low field, in 16-byte units, and stays below 2^14 (shared memory ends below 256 KB), so the sum
// carries into no other field and the high word is unchanged.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return (desc & 0xFFFFFFFF00000000ull) | (static_cast<uint32_t>(desc) + (bytes >> 4));
}

__device__ __forceinline__ void wgmma_fence() {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void wgmma_commit() {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

// Until at most N of the warp's committed wgmma groups are pending (they complete in order).
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// cp.async writes through the generic proxy; wgmma reads through the async proxy.
__device__ __forceinline__ void fence_copies_for_wgmma() {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// mbarriers in shared memory (PTX ISA, "mbarrier"): the forward's copy pipeline between its
// producer warpgroup and its consumers (FwdWsKernel).
__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, unsigned count) {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(count) : "memory");
#endif
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
#endif
}

// The barrier's pending arrival of this thread, made when its earlier cp.async copies have landed.
__device__ __forceinline__ void mbarrier_arrive_on_copies(uint64_t* bar) {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_address(bar)) : "memory");
#endif
}

// Until the phase of the given parity has completed (a new barrier counts the phase before its
// first as completed, parity 1).
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
#ifdef JAXDET_ATTENTION_WGMMA
  const uint32_t addr = smem_address(bar);
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (done == 0);
#endif
}

// The registers of a warpgroup's threads (a multiple of 8, 24-256), moved between warpgroups.
template <int N>
__device__ __forceinline__ void warpgroup_registers_down() {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

template <int N>
__device__ __forceinline__ void warpgroup_registers_up() {
#ifdef JAXDET_ATTENTION_WGMMA
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// The threads [128 id, 128 id + 128) of a warpgroup, barrier id 1 + id (0 is __syncthreads').
__device__ __forceinline__ void warpgroup_sync(int id) {
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + id) : "memory");
}

// Pins the accumulators to their registers around a wgmma batch (no copy of them moves into or out
// of the asynchronous window).
template <int N>
__device__ __forceinline__ void fence_accumulators(float (&d)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
  }
}

// The asm of one wgmma with scale-d 1 (d += A . B): its instruction for the element type T ("bf16"
// or "f16"), the accumulators' operand list, the other operands. A from registers with B MN-major
// (TRANS_B, the P.V product), or A and B K-major in shared memory (SS, the scores).
#define JAXDET_WGMMA_F8(d, i)                                                                       \
  "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3]), "+f"(d[i + 1][0]), "+f"(d[i + 1][1]), \
      "+f"(d[i + 1][2]), "+f"(d[i + 1][3])
// The head of a m64n64k16 wgmma: the predicate of scale-d from operand SCALE_D, the instruction,
// the 32 accumulators of the warpgroup's 64 x 64 tile (operands 0-31, JAXDET_WGMMA_OUT32).
#define JAXDET_WGMMA_M64N64K16(T, SCALE_D)                                                                \
  "{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE_D ", 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32." T "." T \
  " {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,"          \
  "%25,%26,%27,%28,%29,%30,%31}"
#define JAXDET_WGMMA_OUT32(d) \
  JAXDET_WGMMA_F8(d, 0), JAXDET_WGMMA_F8(d, 2), JAXDET_WGMMA_F8(d, 4), JAXDET_WGMMA_F8(d, 6)
#define JAXDET_WGMMA_N64_TRANS_B(T)                                    \
  JAXDET_WGMMA_M64N64K16(T, "%37")                                     \
  ", {%32,%33,%34,%35}, %36, p, 1, 1, 1;\n}\n" : JAXDET_WGMMA_OUT32(d) \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)
#define JAXDET_WGMMA_N64_SS(T)     \
  JAXDET_WGMMA_M64N64K16(T, "%34") \
  ", %32, %33, p, 1, 1, 0, 0;\n}\n" : JAXDET_WGMMA_OUT32(d) : "l"(a), "l"(b), "r"(1)
#define JAXDET_WGMMA_N128_TRANS_B(T)                                                                             \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32." T "." T               \
  " "                                                                                                            \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,"      \
  "%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,"     \
  "%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 1;\n}\n" : JAXDET_WGMMA_F8(d, 0),  \
                                                                                         JAXDET_WGMMA_F8(d, 2),  \
                                                                                         JAXDET_WGMMA_F8(d, 4),  \
                                                                                         JAXDET_WGMMA_F8(d, 6),  \
                                                                                         JAXDET_WGMMA_F8(d, 8),  \
                                                                                         JAXDET_WGMMA_F8(d, 10), \
                                                                                         JAXDET_WGMMA_F8(d, 12), \
                                                                                         JAXDET_WGMMA_F8(d, 14)  \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)

// d (64 x 64 per warpgroup: the warp's 16 rows, 8 tiles of 8 columns) += A . B, A from registers
// (the mma.sync A fragment), B MN-major (the P.V product at head dimension 64).
template <class Elem>
__device__ __forceinline__ void wgmma_n64_trans_b(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b) {
#ifdef JAXDET_ATTENTION_WGMMA
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    asm volatile(JAXDET_WGMMA_N64_TRANS_B("bf16"));
  } else {
    asm volatile(JAXDET_WGMMA_N64_TRANS_B("f16"));
  }
#endif
}

// d (64 x 128 per warpgroup) += A . B, B MN-major (the P.V product at head dimension 128).
template <class Elem>
__device__ __forceinline__ void wgmma_n128_trans_b(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) {
#ifdef JAXDET_ATTENTION_WGMMA
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    asm volatile(JAXDET_WGMMA_N128_TRANS_B("bf16"));
  } else {
    asm volatile(JAXDET_WGMMA_N128_TRANS_B("f16"));
  }
#endif
}
// d (64 x 64 per warpgroup) += A . B, A and B K-major tiles in shared memory.
template <class Elem>
__device__ __forceinline__ void wgmma_n64_ss(float (&d)[8][4], uint64_t a, uint64_t b) {
#ifdef JAXDET_ATTENTION_WGMMA
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    asm volatile(JAXDET_WGMMA_N64_SS("bf16"));
  } else {
    asm volatile(JAXDET_WGMMA_N64_SS("f16"));
  }
#endif
}
#undef JAXDET_WGMMA_N128_TRANS_B
#undef JAXDET_WGMMA_N64_SS
#undef JAXDET_WGMMA_N64_TRANS_B
#undef JAXDET_WGMMA_OUT32
#undef JAXDET_WGMMA_M64N64K16
#undef JAXDET_WGMMA_F8

// Whether JAXDET_TESTING's attention item (read once per process) is `value`.
inline bool attention_testing_is(const char* value) {
  static const std::string item = [] {
    const std::string* v = testing_override("attention");
    return v != nullptr ? *v : std::string();
  }();
  return item == value;
}

// Whether the forward's final mode and the backward run WgmmaCore: on a compute capability 9.0 GPU
// (the only one the sm_90a code runs on) when the build has that code (JAXDET_ATTENTION_SM90A,
// CMakeLists.txt), unless JAXDET_TESTING=attention=mma forces the mma.sync core, as the tests that
// compare the cores do.
inline bool wgmma_enabled() {
#ifdef JAXDET_ATTENTION_SM90A
  const bool mma_forced = attention_testing_is("mma");
  int device = 0, major = 0, minor = 0;
  if (mma_forced || cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    if (!mma_forced) cudaGetLastError();  // not left for the launch check
    return false;
  }
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

// Whether the Hopper final mode runs FwdWsKernel (attention_wgmma_fwd.cuh), unless
// JAXDET_TESTING=attention=wgmma forces FwdKernel's one-warpgroup CTAs (the same bits).
inline bool warp_specialized_forward_enabled() { return !attention_testing_is("wgmma"); }

// The forward's tensor-core core on wgmma: one row group (16 rows) per warp, warps in whole
// warpgroups; for head dimensions 64 and 128 (the P.V accumulators of 256 do not fit beside the
// scores).
template <class ElemT, int kD>
struct WgmmaCore {
  using Elem = ElemT;
  static constexpr int D = kD, kGroups = 1, kHalf = kBlock * 64 * static_cast<int>(sizeof(Elem));
  static_assert(D == 64 || D == 128, "wgmma core: head dimension 64 or 128");
  static constexpr size_t kTile = size_t{kBlock} * D * sizeof(Elem);  // K or V, 1024-byte multiple
  static constexpr size_t kTileAlign = 1024;                          // the swizzle's period
  static constexpr bool kWarpgroupScores = true;
  // scores_issue and pv_issue return with their wgmma in flight: FwdKernel overlaps a block's
  // softmax with the previous block's P.V.
  static constexpr bool kAsync = true;
  using Probs = uint32_t[4][4];  // a block's probabilities as the P.V product's A fragments

  // kBlock rows first_row, first_row + row_stride, ... into the swizzled tile; rows from
  // `valid_rows` on are zero-filled (as MmaSyncCore's tiles). A thread copies one 16-byte chunk of
  // every kStep-th row: the swizzle's row term (row % 8) is then the same for all of them.
  // `tid`: the thread's index among the kThreads that copy.
  template <int kThreads>
  static __device__ __forceinline__ void load_tile(Elem* tile, const Elem* first_row, int64_t row_stride,
                                                   int valid_rows, const Elem* any, int tid = threadIdx.x) {
    constexpr int kChunks = D / 8, kStep = kThreads / kChunks;
    static_assert(kThreads % kChunks == 0 && kBlock % kStep == 0 && kStep % 8 == 0, "whole atoms per pass");
    const int i0 = tid / kChunks, c = tid % kChunks;
    const Elem* src = first_row + i0 * row_stride + c * 8;
    unsigned char* dst =
        reinterpret_cast<unsigned char*>(tile) + (c / 8) * kHalf + i0 * 128 + ((c % 8) ^ (i0 % 8)) * 16;
    if (valid_rows >= kBlock) {  // every row: no per-row test or address select
#pragma unroll
      for (int n = 0; n < kBlock / kStep; ++n) {
        cp_async16(dst + n * kStep * 128, src, true);
        src += kStep * row_stride;
      }
      return;
    }
#pragma unroll
    for (int n = 0; n < kBlock / kStep; ++n) {
      const bool valid = i0 + n * kStep < valid_rows;
      cp_async16(dst + n * kStep * 128, valid ? src : any, valid);
      src += kStep * row_stride;
    }
  }

  static __device__ __forceinline__ void tiles_written() { fence_copies_for_wgmma(); }

  // Where load_tile puts chunk c of a row (for attention_nonfinite.cuh), and load_query_tile: the Q
  // tile has the K tile's layout, the scores' A operand read from shared memory as B is.
  struct Chunks {
    template <class T>  // Elem or const Elem
    __device__ __forceinline__ T* operator()(T* tile, int row, int c) const {
      return tile + ((c / 8) * kHalf + row * 128 + ((c % 8) ^ (row % 8)) * 16) / static_cast<int>(sizeof(Elem));
    }
  };

  // The Q tile: one such tile per warpgroup (64 rows each), one after the other.
  struct QueryChunks {
    template <class T>
    __device__ __forceinline__ T* operator()(T* tile, int row, int c) const {
      return Chunks{}(tile + (row / kBlock) * (kTile / sizeof(Elem)), row % kBlock, c);
    }
  };
  static constexpr size_t query_tile_bytes(int rows) { return rows % kBlock == 0 ? rows / kBlock * kTile : 0; }

  const Elem* Q;  // the warpgroup's 64 rows of the Q tile
  float zero;     // Problem::zero

  __device__ __forceinline__ WgmmaCore(const Elem* q_tile, int warp, int, const Problem& p)
      : Q(q_tile + (warp / 4) * (kTile / sizeof(Elem))), zero(p.zero) {}

  // s = Q . K^T for the block: a chain over the head dimension in ascending 16-wide steps from
  // +0, issued as one wgmma group (wait_scores ends it), both operands read from shared memory (the
  // same products as from registers: the mma.sync fragment layout is the operand's either way). The
  // accumulators start from Problem::zero because ptxas turns a chain from literal zeros into one
  // whose first step does not add C (scale-d 0), not the operation mma.sync's first step is (it
  // adds +0).
  __device__ __forceinline__ void scores_issue(const Elem* Kt, float (&s)[1][8][4]) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[0][nt][0] = s[0][nt][1] = s[0][nt][2] = s[0][nt][3] = zero;
    fence_accumulators(s[0]);
    wgmma_fence();
    const uint64_t q_desc = sw128_desc(Q, 16, 1024), k_desc = sw128_desc(Kt, 16, 1024);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      const uint32_t offset = (ks / 4) * kHalf + (ks % 4) * 32;
      wgmma_n64_ss<Elem>(s[0], desc_advance(q_desc, offset), desc_advance(k_desc, offset));
    }
    wgmma_commit();
  }

  // Until the scores are in, with at most N later groups still pending.
  template <int N>
  static __device__ __forceinline__ void wait_scores(float (&s)[1][8][4]) {
    wgmma_wait<N>();
    fence_accumulators(s[0]);
  }

  // P rounded to Elem as MmaSyncCore rounds it, in the A fragment layout.
  static __device__ __forceinline__ void pack_probs(const float (&x)[1][8][4], Probs& a) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      a[kk][0] = MmaElem<Elem>::pack(x[0][2 * kk][0], x[0][2 * kk][1]);
      a[kk][1] = MmaElem<Elem>::pack(x[0][2 * kk][2], x[0][2 * kk][3]);
      a[kk][2] = MmaElem<Elem>::pack(x[0][2 * kk + 1][0], x[0][2 * kk + 1][1]);
      a[kk][3] = MmaElem<Elem>::pack(x[0][2 * kk + 1][2], x[0][2 * kk + 1][3]);
    }
  }

  // acc += P . V for the block: a chain over its keys in ascending 16-key steps, issued as one
  // wgmma group (wait_pv ends it; until then neither acc nor a may be touched).
  __device__ __forceinline__ void pv_issue(const Probs& a, const Elem* Vt, float (&acc)[1][D / 8][4]) {
    fence_accumulators(acc[0]);
    wgmma_fence();
    const uint64_t v_desc = sw128_desc(Vt, kHalf, 1024);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      const uint64_t desc = desc_advance(v_desc, kk * 16 * 128);
      if constexpr (D == 64) {
        wgmma_n64_trans_b<Elem>(acc[0], a[kk], desc);
      } else {
        wgmma_n128_trans_b<Elem>(acc[0], a[kk], desc);
      }
    }
    wgmma_commit();
  }

  static __device__ __forceinline__ void wait_pv(float (&acc)[1][D / 8][4]) {
    wgmma_wait<0>();
    fence_accumulators(acc[0]);
  }

  // The same products, each ended before it returns.
  __device__ __forceinline__ void scores(const Elem* Kt, float (&s)[1][8][4]) {
    scores_issue(Kt, s);
    wait_scores<0>(s);
  }
  __device__ __forceinline__ void pv(const float (&x)[1][8][4], const Elem* Vt, float (&acc)[1][D / 8][4]) {
    Probs a;
    pack_probs(x, a);
    pv_issue(a, Vt, acc);
    wait_pv(acc);
  }
};

}  // namespace
}  // namespace attn
}  // namespace jaxdet
