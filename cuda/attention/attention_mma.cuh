// The bfloat16/float16 kernels of jaxdet.attention on tensor cores (mma.sync m16n8k16, float32
// accumulation; sm_80 and later). Included by attention_cuda.cu only.
//
// Fragment layouts (PTX ISA, mma.m16n8k16; lane = 4 * grp + q4):
//   A 16x16: reg0 (row grp, cols 2q4, 2q4+1), reg1 (row grp+8, same cols), reg2 (row grp,
//            cols 2q4+8, +9), reg3 (row grp+8, cols 2q4+8, +9); the lower column in the low half.
//   B 16x8:  reg0 (k 2q4, 2q4+1; n grp), reg1 (k 2q4+8, +9; n grp).
//   C 16x8:  c0, c1 (row grp, cols 2q4, 2q4+1), c2, c3 (row grp+8, same cols).
// The C fragments of two adjacent 8-column tiles are the A fragment of the 16-column k step, so
// probabilities feed the P.V product without leaving registers.
//
// Shared-memory tiles are row-major with a pitch of D + 8 elements (16 bytes of padding), which
// makes ldmatrix conflict-free.
#pragma once

#include "common/mma_sm80.cuh"

namespace jaxdet {
namespace attn {
namespace {

constexpr int kPad = 8;

template <class Elem>
struct MmaElem;

template <>
struct MmaElem<__nv_bfloat16> {
  using Storage = BF16Storage;
  static constexpr uint16_t kExponentBits = 0x7f80;  // all set: inf or NaN
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_m16n8k16<true>(d, a, b0, b1);
  }
};

template <>
struct MmaElem<__half> {
  using Storage = F16Storage;
  static constexpr uint16_t kExponentBits = 0x7c00;
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma_m16n8k16<false>(d, a, b0, b1);
  }
};

// The A fragment of the 16 rows at A (pitch P), columns k0 .. k0 + 15 (the layout above), in one
// ldmatrix.
template <int P, class Elem>
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const Elem* A, int k0, int lane) {
  ldsm_x4(a, A + ((lane & 7) + ((lane >> 3) & 1) * 8) * P + k0 + (lane >> 4) * 8);
}

// The B fragments of two adjacent 8-column tiles, n0 .. n0 + 7 (b[0], b[1]) and n0 + 8 .. n0 + 15
// (b[2], b[3]), at k0 .. k0 + 15, from a row-major tile of B^T (row n holds column n of B).
template <int P, class Elem>
__device__ __forceinline__ void load_b_frags(uint32_t (&b)[4], const Elem* Bt, int n0, int k0, int lane) {
  ldsm_x4(b, Bt + (n0 + (lane >> 4) * 8 + (lane & 7)) * P + k0 + ((lane >> 3) & 1) * 8);
}

// max_nan (attention_math.h) in one instruction (fmax_nan, cuda_common.h): the canonical NaN when
// either input is NaN (every NaN these kernels compute is canonical already) and +0 for (+0, -0),
// where max_nan keeps the first of two equal values. A block maximum can so differ only in the
// sign of a zero, which no result sees: m enters as exp2(x - m) and exp2(m_old - m), the same for
// +0 and -0, and as lse2 = m + log2(l) with log2(l) >= +0 (l >= 1: the maximum's own term is 1).

// Copies the kBlock key/value rows first_row, first_row + row_stride, ... into a tile of pitch
// D + kPad; rows from `valid_rows` on are zero-filled (`any` is then the address given to the
// copy, which reads nothing from it). Each thread copies one 16-byte column chunk of every
// (kThreads / (D / 8))-th row, so its addresses advance by a constant.
template <class Elem, int D, int kThreads>
__device__ __forceinline__ void load_rows_tile(Elem* tile, const Elem* first_row, int64_t row_stride,
                                               int valid_rows, const Elem* any,
                                               int tid = static_cast<int>(threadIdx.x)) {
  constexpr int kChunks = D / 8, kStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kBlock % kStep == 0, "whole rows per pass of the threads");
  const int i0 = tid / kChunks, col = (tid % kChunks) * 8;
  const Elem* src = first_row + i0 * row_stride + col;
  Elem* dst = tile + i0 * (D + kPad) + col;
  if (valid_rows >= kBlock) {
#pragma unroll
    for (int n = 0; n < kBlock / kStep; ++n) {
      cp_async16(dst + n * kStep * (D + kPad), src, true);
      src += kStep * row_stride;
    }
    return;
  }
#pragma unroll
  for (int n = 0; n < kBlock / kStep; ++n) {
    const bool valid = i0 + n * kStep < valid_rows;
    cp_async16(dst + n * kStep * (D + kPad), valid ? src : any, valid);
    src += kStep * row_stride;
  }
}

// Where load_rows_tile and load_query_tile put chunk c (8 elements) of a row: a row-major tile of
// pitch D + kPad.
template <int D>
struct PaddedChunks {
  template <class Elem>
  __device__ __forceinline__ Elem* operator()(Elem* tile, int row, int c) const {
    return tile + row * (D + kPad) + c * 8;
  }
};

// t = r / G for a query row r (r < 2^31 + 64: check_grid bounds R), in 32-bit arithmetic.
__device__ __forceinline__ int64_t row_time(const Problem& p, int64_t r) {
  return static_cast<int64_t>(static_cast<uint32_t>(r) / static_cast<uint32_t>(p.G));
}

// Copies the query rows r0 .. r0 + kQueryRows - 1 of (b, h) (row r is (t, g) = (r / G, r % G), at
// q_index) from `base` (q or dO) into a tile laid out by Chunks (pitch D + kPad, or WgmmaCore's
// swizzled atoms); rows from R on are zero-filled. As in load_rows_tile each thread copies one
// column chunk of every kStep-th row; (t, g) advances by (kStep / G, kStep % G) with a carry, so the
// thread divides once per tile and its address moves by one of two constants per row.
template <class Elem, int D, int kThreads, int kQueryRows, class Chunks = PaddedChunks<D>>
__device__ __forceinline__ void load_query_tile(Elem* tile, const Elem* base, const Problem& p, int64_t b,
                                                int64_t h, int64_t r0) {
  constexpr int kChunks = D / 8, kStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kQueryRows % kStep == 0, "whole rows per pass of the threads");
  const int i0 = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks, col = c * 8;
  const int G = static_cast<int>(p.G);
  const int dg = kStep % G;
  const int64_t time_stride = p.H * p.G * D;  // elements between the rows of consecutive times
  const int64_t step = (kStep / G) * time_stride + int64_t{dg} * D, carry = time_stride - int64_t{G} * D;
  const int64_t t = row_time(p, r0 + i0);
  int g = static_cast<int>(r0 + i0 - t * G);
  const Elem* src = base + ((b * p.T + t) * p.H + h) * G * D + int64_t{g} * D + col;
#pragma unroll
  for (int n = 0; n < kQueryRows / kStep; ++n) {
    const bool valid = r0 + i0 + n * kStep < p.R;
    cp_async16(Chunks{}(tile, i0 + n * kStep, c), valid ? src : base, valid);
    g += dg;
    src += step;
    if (g >= G) {
      g -= G;
      src += carry;
    }
  }
}

}  // namespace
}  // namespace attn
}  // namespace jaxdet

#include "attention/attention_nonfinite.cuh"
#include "attention/attention_wgmma.cuh"

namespace jaxdet {
namespace attn {
namespace {

// The rows of a CTA and the passes over them. A pass takes the rows whose keys start at one
// memory row (one sequence of a packed batch; all rows otherwise), in ascending start order; the
// other rows see no key in it, which leaves their state unchanged.
struct PassRows {
  int* start;  // [kRows], INT_MAX for rows past R
  int* limit;  // [kRows]
};

template <int kRows, int kThreads>
__device__ __forceinline__ void load_row_info(const Problem& p, int64_t b, int64_t r0, PassRows rows) {
  for (int i = threadIdx.x; i < kRows; i += kThreads) {
    const int64_t r = r0 + i;
    if (r < p.R) {
      const RowKeys k = row_keys(p.rows, p.T, p.S, b, row_time(p, r));
      rows.start[i] = static_cast<int>(k.start);
      rows.limit[i] = static_cast<int>(k.limit);
    } else {
      rows.start[i] = INT_MAX;
      rows.limit[i] = 0;
    }
  }
}

// The next pass after the one starting at `cur` (-1 before the first): its start, or INT_MAX, and
// the largest limit of its rows. Every warp computes it (the lanes split the rows, then a warp
// reduction), so all get the same answer without a barrier; every lane of the CTA calls it.
template <int kRows>
__device__ __forceinline__ int next_pass(PassRows rows, int cur, int* pass_limit) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  int next = INT_MAX;
#pragma unroll
  for (int i = lane; i < kRows; i += 32) {
    const int s = rows.start[i];
    if (s > cur && s < next) next = s;
  }
  next = __reduce_min_sync(kFullMask, next);
  int limit = 0;
#pragma unroll
  for (int i = lane; i < kRows; i += 32) {
    if (rows.start[i] == next) limit = max(limit, rows.limit[i]);
  }
  *pass_limit = __reduce_max_sync(kFullMask, limit);
  return next;
}

// The barrier of a CTA of kThreads threads; one warp's is the warp's (its memory ordering as
// well: the lanes' shared-memory writes and finished copies before it are seen after it).
template <int kThreads>
__device__ __forceinline__ void cta_barrier() {
  if constexpr (kThreads == 32) {
    __syncwarp();
  } else {
    __syncthreads();
  }
}

// The barrier, and whether x is true in any thread.
template <int kThreads>
__device__ __forceinline__ bool cta_barrier_or(bool x) {
  if constexpr (kThreads == 32) {
    __syncwarp();
    return __any_sync(kFullMask, x);
  } else {
    return __syncthreads_or(x);
  }
}

// ---- Forward. ----

struct SplitOut {
  float* acc;  // [B, H, nsplit, R, D]
  float2* ml;  // [B, H, nsplit, R]: (m, l) of each split
  int64_t nsplit;  // 0: final mode (the kernel merges the splits and writes o and lse2)
};

// A lane's share of the final mode's running totals (M, L, ACC) of its warp's rows, kept in
// shared memory, lane-interleaved so that each access is conflict-free: the lane's accumulator
// elements (per group: D/8 tiles x 4), then M and L of its 2 G rows.
template <int G, int D>
struct RunningTotal {
  static constexpr int kPerLane = G * D / 2 + 4 * G;  // floats
  static constexpr size_t warp_bytes() { return size_t{32} * kPerLane * sizeof(float); }

  float* acc;  // [g][dt][i] at ((g * (D / 8) + dt) * 4 + i) * 32
  float* m;    // [g][rr] at (g * 2 + rr) * 32
  float* l;

  // The accumulators are read only once their row's total holds a split (M > -inf): until then
  // they count as 0 (the merge into an empty total reads 0), so they need no initial zeros.
  __device__ __forceinline__ RunningTotal(float* stash, int warp, int lane)
      : acc(stash + warp * kPerLane * 32 + lane), m(acc + G * (D / 2) * 32), l(m + 2 * G * 32) {}

  __device__ __forceinline__ void clear() {
    for (int i = 0; i < 2 * G; ++i) {
      m[i * 32] = dm::neg_inf();
      l[i * 32] = 0.0f;
    }
  }

  // Merges a split's state (step 3 of the canonical order), rows whose split saw a key only.
  __device__ __forceinline__ void merge(const float (&ms)[G][2], const float (&ls)[G][2],
                                        const float (&as)[G][D / 8][4]) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        if (split_is_empty(ms[g][rr])) continue;
        float& mt = m[(g * 2 + rr) * 32];
        float& lt = l[(g * 2 + rr) * 32];
        const bool total_empty = mt == dm::neg_inf();
        const Rescale rs = rescale<FastMath>(mt, ms[g][rr]);
        lt = merge_term(lt, rs.old_scale, ls[g][rr], rs.in_scale);
        if (total_empty && rs.in_scale == 1.0f) {
          // A row's first split (a finite maximum): merge_term(0, 0, x, 1) is 0 + x, for every x
          // (x * 1 == x, NaN stays the canonical NaN), so the old total is not read.
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
            for (int i = 2 * rr; i < 2 * rr + 2; ++i)
              acc[((g * (D / 8) + dt) * 4 + i) * 32] = dm::add(0.0f, as[g][dt][i]);
          }
        } else {
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
            for (int i = 2 * rr; i < 2 * rr + 2; ++i) {
              float& t = acc[((g * (D / 8) + dt) * 4 + i) * 32];
              t = merge_term(total_empty ? 0.0f : t, rs.old_scale, as[g][dt][i], rs.in_scale);
            }
          }
        }
        mt = rs.m_new;
      }
    }
  }

  // Step 4: out and lse2 of the lane's rows below R.
  template <class Storage>
  __device__ __forceinline__ void store(const Problem& p, void* o, float* lse2, int64_t b, int64_t h, int64_t r0,
                                        const int (&row_local)[G][2], int q4) const {
    using Bits = typename Storage::Bits;
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int64_t r = r0 + row_local[g][rr];
        if (r >= p.R) continue;
        Bits* out = static_cast<Bits*>(o) + q_index(p, b, h, r);
        const float mt = m[(g * 2 + rr) * 32], lt = l[(g * 2 + rr) * 32];
        const bool total_empty = mt == dm::neg_inf();
        const float inv_l = out_scale(lt);
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          const float* t = acc + ((g * (D / 8) + dt) * 4 + 2 * rr) * 32;
          const Bits lo = Storage::store(finish_out(total_empty ? 0.0f : t[0], inv_l));
          const Bits hi = Storage::store(finish_out(total_empty ? 0.0f : t[32], inv_l));
          *reinterpret_cast<uint32_t*>(out + dt * 8 + 2 * q4) =
              static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
        }
        if (q4 == 0) lse2[stat_index(p, b, h, r)] = finish_lse2<FastMath>(mt, lt);
      }
    }
  }
};

// Shared memory of a forward CTA: the V tiles and the K tile first (Core::kTileAlign: wgmma's swizzle
// needs 1024-byte-aligned tiles), then the query tile, the row descriptions and the running totals.
template <class Core, int kWarps>
struct FwdGeom {
  using Elem = typename Core::Elem;
  static constexpr int D = Core::D, kGroups = Core::kGroups;
  static constexpr int kRows = 16 * kGroups * kWarps;
  static constexpr size_t kKV = Core::kTile;
  static_assert(kKV % Core::kTileAlign == 0, "tiles keep their alignment");
  static constexpr size_t kQ = Core::query_tile_bytes(kRows);
  static_assert(kQ > 0, "the core takes a Q tile of the CTA's rows");
  static constexpr size_t kRowInfo = size_t{2} * kRows * sizeof(int);
  static constexpr size_t kStash = kWarps * RunningTotal<kGroups, D>::warp_bytes();  // final mode
  // FwdKernel's overlapped loop (Core::kAsync) keeps two V tiles.
  static constexpr bool kOverlapped = Core::kAsync;
  static constexpr size_t kVTiles = kOverlapped ? 2 : 1;
  static constexpr size_t kTiles = (kVTiles + 1) * kKV;
  static constexpr size_t kCols = NonFiniteCols<D>::kBytes;  // of the V tile
  static constexpr size_t bytes(bool final_mode) {
    return kTiles + kQ + kRowInfo + kCols + (final_mode ? kStash : 0);
  }
};

// s[g] = scores of the warp's row group g (16 rows at A + 16 g rows, pitch D + kPad) against the
// 64 rows of Bt: each K fragment is loaded once for all groups; every element is an MMA chain over
// the head dimension in ascending 16-wide steps from +0.
template <class Elem, int D, int G>
__device__ __forceinline__ void groups_dot_tile(const Elem* A, const Elem* Bt, float (&s)[G][8][4], int lane) {
  constexpr int P = D + kPad;
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[g][nt][0] = s[g][nt][1] = s[g][nt][2] = s[g][nt][3] = 0.0f;
  }
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) load_a_frag<P>(a[g], A + g * 16 * P, ks * 16, lane);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t bf[4];
      load_b_frags<P>(bf, Bt, np * 16, ks * 16, lane);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        MmaElem<Elem>::mma(s[g][2 * np], a[g], bf[0], bf[1]);
        MmaElem<Elem>::mma(s[g][2 * np + 1], a[g], bf[2], bf[3]);
      }
    }
  }
}

// acc[g] += x[g] . M for every row group (x rounded to Elem), each fragment of M loaded once: per
// element an MMA chain over M's 64 rows in ascending 16-row steps.
template <class Elem, int D, int G>
__device__ __forceinline__ void groups_times_rows(const float (&x)[G][8][4], const Elem* M,
                                                  float (&acc)[G][D / 8][4], int lane) {
  constexpr int P = D + kPad;
  const int mi = lane >> 3, mr = lane & 7;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    uint32_t a[G][4];
#pragma unroll
    for (int g = 0; g < G; ++g) {
      a[g][0] = MmaElem<Elem>::pack(x[g][2 * kk][0], x[g][2 * kk][1]);
      a[g][1] = MmaElem<Elem>::pack(x[g][2 * kk][2], x[g][2 * kk][3]);
      a[g][2] = MmaElem<Elem>::pack(x[g][2 * kk + 1][0], x[g][2 * kk + 1][1]);
      a[g][3] = MmaElem<Elem>::pack(x[g][2 * kk + 1][2], x[g][2 * kk + 1][3]);
    }
    const Elem* row = M + (kk * 16 + (mi & 1) * 8 + mr) * P + (mi >> 1) * 8;
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t b[4];
      ldsm_x4_trans(b, row + dp * 16);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        MmaElem<Elem>::mma(acc[g][2 * dp], a[g], b[0], b[1]);
        MmaElem<Elem>::mma(acc[g][2 * dp + 1], a[g], b[2], b[3]);
      }
    }
  }
}

// The forward's tensor-core core on mma.sync (sm_80 and later): kG row groups of 16 rows per warp,
// K and V tiles of pitch D + kPad. FwdKernel runs it or WgmmaCore (attention_wgmma.cuh), which
// compute the same bits.
template <class ElemT, int kD, int kG>
struct MmaSyncCore {
  using Elem = ElemT;
  static constexpr int D = kD, kGroups = kG;
  static constexpr size_t kTile = size_t{kBlock} * (D + kPad) * sizeof(Elem);  // K or V
  static constexpr size_t kTileAlign = 16;
  static constexpr bool kWarpgroupScores = false;
  static constexpr bool kAsync = false;  // scores and pv return their results

  template <int kThreads>
  static __device__ __forceinline__ void load_tile(Elem* tile, const Elem* first_row, int64_t row_stride,
                                                   int valid_rows, const Elem* any) {
    load_rows_tile<Elem, D, kThreads>(tile, first_row, row_stride, valid_rows, any);
  }
  static __device__ __forceinline__ void tiles_written() {}
  using Chunks = PaddedChunks<D>;       // where load_tile puts a thread's chunks
  using QueryChunks = PaddedChunks<D>;  // and load_query_tile
  static constexpr size_t query_tile_bytes(int rows) { return size_t(rows) * (D + kPad) * sizeof(Elem); }

  const Elem* Qw;  // the warp's first query row in the Q tile
  int lane;

  __device__ __forceinline__ MmaSyncCore(const Elem* q_tile, int warp, int lane_id, const Problem&)
      : Qw(q_tile + warp * kG * 16 * (D + kPad)), lane(lane_id) {}
  __device__ __forceinline__ void scores(const Elem* Kt, float (&s)[kG][8][4]) {
    groups_dot_tile<Elem, D, kG>(Qw, Kt, s, lane);
  }
  __device__ __forceinline__ void pv(const float (&x)[kG][8][4], const Elem* Vt, float (&acc)[kG][D / 8][4]) {
    groups_times_rows<Elem, D, kG>(x, Vt, acc, lane);
  }
};

// The first half of a block's online softmax for one row group (16 rows, two per lane: grp and
// grp + 8), keys at positions pos0 .. pos0 + 63 of the pass: the scores scaled by c (keys at or
// past the row's limit lim[] masked to -inf) and the lane's maximum of each row over the block.
// kMasked false: every key of the block is visible to both rows, where the mask would keep every
// score (the same bits without the compares).
template <bool kMasked>
__device__ __forceinline__ void block_scores_max(int pos0, const int (&lim)[2], float c, float (&s)[8][4],
                                                 float (&bm)[2], int q4) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = pos0 + nt * 8 + 2 * q4 + (i & 1);
      s[nt][i] = !kMasked || key < lim[i >> 1] ? dm::mul(s[nt][i], c) : dm::neg_inf();
    }
  }
  // A tree (exact: the maximum does not depend on the order, fmax_nan settles (+0, -0) and NaN
  // the same way in either order), both rows interleaved.
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float t[8];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) t[nt] = fmax_nan(s[nt][2 * rr], s[nt][2 * rr + 1]);
#pragma unroll
    for (int w = 4; w >= 1; w /= 2) {
#pragma unroll
      for (int i = 0; i < w; ++i) t[i] = fmax_nan(t[i], t[i + w]);
    }
    bm[rr] = t[0];
  }
}

// A row's maximum from its 4 lanes' (the same on all 4).
__device__ __forceinline__ float row_max_of_lanes(float x) {
  x = fmax_nan(x, __shfl_xor_sync(kFullMask, x, 1));
  return fmax_nan(x, __shfl_xor_sync(kFullMask, x, 2));
}

// The second half, given each row's running maximum before the block (m_old) and the block's
// (bm: the lane's when kLaneMax, reduced over the row's lanes here; otherwise the row's): the new
// maximum mn, the factor alpha of the accumulators, the probabilities (left in s for the P.V
// product) and their sum ts, the lane's in (tile, column) order, then across the row's 4 lanes by
// a butterfly (the same value on all 4).
template <bool kLaneMax>
__device__ __forceinline__ void block_probs(const float (&m_old)[2], float (&bm)[2], float (&s)[8][4],
                                            float (&mn)[2], float (&alpha)[2], float (&ts)[2]) {
  bool empty[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    if constexpr (kLaneMax) bm[rr] = row_max_of_lanes(bm[rr]);
    mn[rr] = max_nan(m_old[rr], bm[rr]);
    empty[rr] = mn[rr] == dm::neg_inf();
    alpha[rr] = empty[rr] ? 1.0f : FastMath::exp2(dm::sub(m_old[rr], mn[rr]));
  }
  float sum[2] = {0.0f, 0.0f};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rr = i >> 1;
      const float pr = empty[rr] ? 0.0f : FastMath::exp2(dm::sub(s[nt][i], mn[rr]));
      s[nt][i] = pr;
      sum[rr] = dm::add(sum[rr], pr);
    }
  }
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    sum[rr] = dm::add(sum[rr], __shfl_xor_sync(kFullMask, sum[rr], 1));
    ts[rr] = dm::add(sum[rr], __shfl_xor_sync(kFullMask, sum[rr], 2));
  }
}

// One block of the online softmax for the warp's row groups, on the block's scores s (the core's
// product); lim[g][] are the lane's rows' limits. Leaves the block's probabilities in s for the
// P.V product (the core's pv) and the factor of each row's accumulators in alpha: rescale_acc
// applies it after the previous block's P.V and before this block's.
template <int G, bool kMasked>
__device__ __forceinline__ void fwd_softmax(int pos0, const int (&lim)[G][2], float c, float (&m)[G][2],
                                            float (&l)[G][2], float (&s)[G][8][4], float (&alpha)[G][2],
                                            int lane) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    float bm[2], mn[2], ts[2];
    block_scores_max<kMasked>(pos0, lim[g], c, s[g], bm, lane & 3);
    block_probs<true>(m[g], bm, s[g], mn, alpha[g], ts);
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      l[g][rr] = dm::add(dm::mul(l[g][rr], alpha[g][rr]), ts[rr]);
      m[g][rr] = mn[rr];
    }
  }
}

// A split's state before its first block (step 2 of the canonical order): m = -inf, l = 0, acc = 0.
template <int G, int D>
__device__ __forceinline__ void start_split(float (&m)[G][2], float (&l)[G][2], float (&acc)[G][D / 8][4]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g][0] = m[g][1] = dm::neg_inf();
    l[g][0] = l[g][1] = 0.0f;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) acc[g][dt][0] = acc[g][dt][1] = acc[g][dt][2] = acc[g][dt][3] = 0.0f;
  }
}

// acc *= alpha, row by row. x * 1 == x for every float (NaN stays the canonical NaN): a warp whose
// rows kept their maxima skips the rescale.
template <int D, int G>
__device__ __forceinline__ void rescale_acc(const float (&alpha)[G][2], float (&acc)[G][D / 8][4]) {
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (__any_sync(kFullMask, alpha[g][0] != 1.0f || alpha[g][1] != 1.0f)) {
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        acc[g][dt][0] = dm::mul(acc[g][dt][0], alpha[g][0]);
        acc[g][dt][1] = dm::mul(acc[g][dt][1], alpha[g][0]);
        acc[g][dt][2] = dm::mul(acc[g][dt][2], alpha[g][1]);
        acc[g][dt][3] = dm::mul(acc[g][dt][3], alpha[g][1]);
      }
    }
  }
}

// A CTA: kWarps warps of Core::kGroups row groups of 16 rows (in final mode), or one warp of one
// group (split mode, MmaSyncCore). Either way every row runs the core's scores, fwd_softmax and the
// core's P.V on the same blocks. (At least one CTA per SM: without it ptxas spills registers of
// the main loop for an occupancy the shared memory does not allow anyway.)
//
// fwd_cta is the CTA at grid x-index cta_x of (h, b), in `smem` (FwdGeom's layout, 1024-byte
// aligned); fired_flag is its flag (attention_nonfinite.cuh), written by the first launch only.
// With one warp its barriers are the warp's, so that DecodeSplitKernel's warp 0 can run a careful
// CTA in place.
template <class Core, int kWarps, bool kCareful>
__device__ __forceinline__ void fwd_cta(const Problem& p, void* o, float* lse2, const SplitOut& ws,
                                        int* fired_flag, unsigned char* smem, int64_t cta_x, int64_t h,
                                        int64_t b) {
  using Elem = typename Core::Elem;
  using Geo = FwdGeom<Core, kWarps>;
  using Storage = typename MmaElem<Elem>::Storage;
  constexpr int D = Core::D, kRows = Geo::kRows, kThreads = kWarps * 32, G = Core::kGroups;
  Elem* Vs = reinterpret_cast<Elem*>(smem);
  Elem* Ks = reinterpret_cast<Elem*>(smem + Geo::kVTiles * Geo::kKV);
  Elem* Qs = reinterpret_cast<Elem*>(smem + Geo::kTiles);
  PassRows rows{reinterpret_cast<int*>(smem + Geo::kTiles + Geo::kQ), nullptr};
  rows.limit = rows.start + kRows;
  const NonFiniteCols<D> v_cols(smem + Geo::kTiles + Geo::kQ + Geo::kRowInfo);
  float* stash = reinterpret_cast<float*>(smem + Geo::kTiles + Geo::kQ + Geo::kRowInfo + Geo::kCols);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, q4 = lane & 3;
  const bool split_mode = ws.nsplit > 0;
  const int64_t tiles = (p.R + kRows - 1) / kRows;
  const int64_t tile = split_mode ? cta_x % tiles : cta_x;
  const int z = split_mode ? static_cast<int>(cta_x / tiles) : 0;
  const int64_t r0 = tile * kRows;
  const Elem* q = static_cast<const Elem*>(p.q);
  const Elem* k = static_cast<const Elem*>(p.k);
  const Elem* v = static_cast<const Elem*>(p.v);
  const int64_t kv_stride = p.H * p.D;  // elements between consecutive key positions

  load_row_info<kRows, kThreads>(p, b, r0, rows);
  load_query_tile<Elem, D, kThreads, kRows, typename Core::QueryChunks>(Qs, q, p, b, h, r0);
  cp_async_commit();
  RunningTotal<G, D> total(stash, warp, lane);
  if (!split_mode) total.clear();
  if constexpr (kCareful) v_cols.template clear<kThreads>();
  cp_async_wait<0>();
  cta_barrier<kThreads>();

  int row_local[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    row_local[g][0] = (warp * G + g) * 16 + grp;
    row_local[g][1] = row_local[g][0] + 8;
  }
  Core core(Qs, warp, lane, p);
  float m[G][2], l[G][2], acc[G][D / 8][4];
  auto reset = [&]() { start_split<G, D>(m, l, acc); };

  bool fired = false;  // an accumulator element this thread probes is inf or NaN (not kCareful)
  // The block's softmax (unmasked when every key of the block is visible to every row of the warp)
  // and the factors of the accumulators. Given a K tile, the scores against it first: mma.sync's
  // inside each branch (as the register allocation of the split kernel wants), wgmma's before the
  // warps branch (a warpgroup's warps issue it at one instruction). The overlapped loop passes
  // nullptr: its scores are in already.
  auto softmax = [&](int pos0, const int (&lim)[G][2], float (&s)[G][8][4], float (&alpha)[G][2],
                     const Elem* k_tile) {
    bool unmasked = true;
#pragma unroll
    for (int g = 0; g < G; ++g) unmasked = unmasked && pos0 + kBlock <= min(lim[g][0], lim[g][1]);
    if constexpr (Core::kWarpgroupScores) {
      if (k_tile != nullptr) core.scores(k_tile, s);
    }
    if (__all_sync(kFullMask, unmasked)) {
      if constexpr (!Core::kWarpgroupScores) core.scores(k_tile, s);
      fwd_softmax<G, false>(pos0, lim, p.c, m, l, s, alpha, lane);
    } else {
      if constexpr (!Core::kWarpgroupScores) core.scores(k_tile, s);
      fwd_softmax<G, true>(pos0, lim, p.c, m, l, s, alpha, lane);
    }
  };
  // The end of a split: the probe for inf or NaN (an inf or NaN stays in the accumulators until
  // the split's merge resets them), then in final mode the merge into the running total (the
  // stash), rows whose split saw a key only.
  auto end_split = [&]() {
    if (!kCareful) fired = fired || probe_nonfinite<D>(acc[0], p.zero);
    if (split_mode) return;  // a split-mode CTA writes its split's state after the pass
    total.merge(m, l, acc);
    reset();
  };
  int cur = -1, plimit = 0;
  while ((cur = next_pass<kRows>(rows, cur, &plimit)) != INT_MAX) {
    int lim[G][2];
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        lim[g][rr] = rows.start[row_local[g][rr]] == cur ? rows.limit[row_local[g][rr]] : 0;
      }
    }
    const int nblocks = (plimit + kBlock - 1) / kBlock;
    const int blk_begin = split_mode ? z * kBlocksPerSplit : 0;
    const int blk_end = split_mode ? min(nblocks, blk_begin + kBlocksPerSplit) : nblocks;
    if (blk_begin >= blk_end) continue;
    const int pass_start = cur, pass_limit = plimit;
    // The pass's first key and value rows; block blk starts kBlock rows of kv_stride later.
    const int64_t pass_offset = kv_index(p, b, h, pass_start);
    const Elem* k_pass = k + pass_offset;
    const Elem* v_pass = v + pass_offset;
    auto load_block = [&](Elem* tile, const Elem* base, int blk) {
      Core::template load_tile<kThreads>(tile, base + int64_t{blk} * (kBlock * kv_stride), kv_stride,
                                         pass_limit - blk * kBlock, base);
      cp_async_commit();
    };
    reset();
    load_block(Ks, k_pass, blk_begin);
    if constexpr (Geo::kOverlapped && !kCareful) {
      // Block blk's scores and softmax run while the tensor cores add block blk - 1's P.V (its
      // probabilities wait in `pend`); the accumulators take block blk's factor once that P.V is
      // in, so they see the operations of the loop below in the same order. K: one buffer (the
      // next block's copy runs under the softmax); V: two (a copy has a whole block to land). A
      // split's first block has no P.V to overlap and its last adds its own before the merge, so
      // every wgmma is issued and waited for on the same path.
      constexpr size_t kTileElems = Geo::kKV / sizeof(Elem);
      auto begin_block = [&](int blk) {
        cp_async_wait<0>();
        Core::tiles_written();
        cta_barrier<kThreads>();  // K(blk) and V(blk - 1) are in; every warp is done with V(blk - 2)
        Elem* v_tile = Vs + (blk & 1) * kTileElems;
        load_block(v_tile, v_pass, blk);
        return v_tile;
      };
      auto scores_read = [&](int blk) {
        cta_barrier<kThreads>();  // every warp is done with K(blk)
        if (blk + 1 < blk_end) load_block(Ks, k_pass, blk + 1);
      };
      typename Core::Probs pend;
      float s[G][8][4], alpha[G][2];
      for (int s0 = blk_begin; s0 < blk_end; s0 += kBlocksPerSplit) {
        const int s1 = min(s0 + kBlocksPerSplit, blk_end);
        Elem* v_tile = begin_block(s0);
        core.scores(Ks, s);
        scores_read(s0);
        softmax(s0 * kBlock, lim, s, alpha, nullptr);
        rescale_acc<D, G>(alpha, acc);
        Core::pack_probs(s, pend);
        for (int blk = s0 + 1; blk < s1; ++blk) {
          const Elem* v_prev = v_tile;
          v_tile = begin_block(blk);
          core.scores_issue(Ks, s);
          core.pv_issue(pend, v_prev, acc);
          Core::template wait_scores<1>(s);
          scores_read(blk);
          softmax(blk * kBlock, lim, s, alpha, nullptr);
          Core::wait_pv(acc);
          rescale_acc<D, G>(alpha, acc);
          Core::pack_probs(s, pend);
        }
        if (s1 < blk_end) {
          cp_async_wait<1>();  // V(s1 - 1), not K(s1)
        } else {
          cp_async_wait<0>();
        }
        Core::tiles_written();
        cta_barrier<kThreads>();  // V(s1 - 1) is in
        core.pv_issue(pend, v_tile, acc);
        Core::wait_pv(acc);
        end_split();
      }
    } else {
      // One buffer each for K and V: V's copy runs under the scores, the next K's under P.V.
      auto split_done = [&](int blk) { return (blk + 1) % kBlocksPerSplit == 0 || blk + 1 == blk_end; };
      for (int blk = blk_begin; blk < blk_end; ++blk) {
        cp_async_wait<0>();
        Core::tiles_written();
        cta_barrier<kThreads>();  // K(blk) is in, and every warp is done with V(blk - 1)
        load_block(Vs, v_pass, blk);
        const int pos0 = blk * kBlock;
        float s[G][8][4], alpha[G][2];
        softmax(pos0, lim, s, alpha, Ks);
        rescale_acc<D, G>(alpha, acc);
        cp_async_wait<0>();
        Core::tiles_written();
        // V(blk) is in, and every warp is done with K(blk); kCareful: whether V(blk) holds an inf or NaN.
        bool v_nonfinite = false;
        if constexpr (kCareful) {
          v_nonfinite = cta_barrier_or<kThreads>(
              own_chunks_nonfinite<Elem, D, kThreads, kBlock>(Vs, typename Core::Chunks{}, p.zero));
        } else {
          cta_barrier<kThreads>();
        }
        if (blk + 1 < blk_end) load_block(Ks, k_pass, blk + 1);
        if (v_nonfinite) {  // attention_nonfinite.cuh
          clean_own_chunks<Elem, D, kThreads, kBlock>(Vs, typename Core::Chunks{}, v_cols);
          Core::tiles_written();
          cta_barrier<kThreads>();
        }
        core.pv(s, Vs, acc);
        if (v_nonfinite) {
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const auto visible = [&](int nt, int i) { return pos0 + nt * 8 + 2 * q4 + (i & 1) < lim[g][i >> 1]; };
            add_nonfinite_terms<Elem, D>(s[g], visible, v_cols, acc[g], lane);
          }
          cta_barrier<kThreads>();  // every warp has read the masks
          v_cols.template clear<kThreads>();
        }
        if (split_done(blk)) end_split();
      }
    }
    if (split_mode) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int64_t r = r0 + row_local[g][rr];
          if (r >= p.R || rows.start[row_local[g][rr]] != cur) continue;
          const int64_t base = ((b * p.H + h) * ws.nsplit + z) * p.R + r;
#pragma unroll
          for (int dt = 0; dt < D / 8; ++dt) {
            *reinterpret_cast<float2*>(ws.acc + base * D + dt * 8 + 2 * q4) =
                make_float2(acc[g][dt][2 * rr], acc[g][dt][2 * rr + 1]);
          }
          if (q4 == 0) ws.ml[base] = make_float2(m[g][rr], l[g][rr]);
        }
      }
    }
  }
  if constexpr (!kCareful) {
    // A tile held an inf or NaN (or a row's own terms made one): the kCareful launch recomputes
    // this CTA's rows (attention_nonfinite.cuh).
    const bool any_fired = cta_barrier_or<kThreads>(fired);
    if (threadIdx.x == 0) *fired_flag = any_fired ? 1 : 0;
    if (any_fired) return;
  }
  if (!split_mode) total.template store<Storage>(p, o, lse2, b, h, r0, row_local, q4);
}

template <class Core, int kWarps, bool kCareful>
__global__ void __launch_bounds__(kWarps * 32, 1)
    FwdKernel(Problem p, void* o, float* lse2, SplitOut ws, int* fired_ctas) {
  extern __shared__ __align__(1024) unsigned char smem[];
  int* fired_flag = fired_ctas + cta_index();
  if constexpr (kCareful) {
    if (*fired_flag == 0) return;  // the first launch's rows stand
  }
  fwd_cta<Core, kWarps, kCareful>(p, o, lse2, ws, fired_flag, smem, blockIdx.x, blockIdx.y, blockIdx.z);
}

// The running maximum before each of the block's values x (thread i's, in thread order) after
// `carry`, and in *total the running maximum after all of them: the left fold of max_nan, by a
// scan. max_nan is associative (its result is the last NaN if there is one, else the first of the
// largest values) with -inf as its identity, so every grouping gives the walk's bits; an empty
// split (m = -inf), which the walk skips, changes nothing either. Every thread gets *total.
__device__ __forceinline__ float exclusive_max_nan(float x, float carry, float* warp_total, float* total) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  float incl = x;
#pragma unroll
  for (int off = 1; off < 32; off *= 2) {
    const float left = __shfl_up_sync(kFullMask, incl, off);
    if (lane >= off) incl = max_nan(left, incl);
  }
  const float left_in_warp = __shfl_up_sync(kFullMask, incl, 1);
  if (lane == 31) warp_total[warp] = incl;
  __syncthreads();
  float before = carry, all = carry;
  for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) {
    if (w == warp) before = all;
    all = max_nan(all, warp_total[w]);
  }
  *total = all;
  return lane == 0 ? before : max_nan(before, left_in_warp);
}

// Split mode's second step: a CTA per row, a thread per output column (blockDim.x == D), merges
// the row's splits 0 .. ceil(limit / kSplit) - 1 in ascending order with the functions and the
// order of the final mode's in-kernel merge. A split's two factors (the rescale of the running
// maximum before it against its own maximum) depend on the row's (m, l) values only: a scan gives
// every split its running maximum (exclusive_max_nan), the factors of a chunk of splits are
// computed side by side, and each column then runs only its chain of merge_term over the splits.
// Every value gets the operations it gets when one thread walks the splits one after the other:
// the same bits. The first chunk's loads do not wait for the row's limit (a split past it is
// loaded and left out: the workspace holds nsplit splits per row).
template <typename Storage>
__global__ void __launch_bounds__(256) CombineKernel(Problem p, SplitOut ws, void* o, float* lse2) {
  constexpr int kMaxChunk = 256;  // splits per round: blockDim.x (the head dimension)
  constexpr int kBatch = 64;      // partial outputs loaded before their merges (32768 positions: 64 splits)
  __shared__ float2 ml[kMaxChunk];       // each split's (m, l); (-inf, 0) past the row's splits
  __shared__ float2 factors[kMaxChunk];  // rescale(running maximum before, m): (old_scale, in_scale)
  __shared__ float warp_total[kMaxChunk / 32];
  const int e = threadIdx.x, chunk = blockDim.x;
  const int64_t rows = p.B * p.H * p.R;
  const int64_t split_stride = p.R * p.D;  // from a split's partial output row to the next split's
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t r = row % p.R, bh = row / p.R;
    const int64_t h = bh % p.H, b = bh / p.H;
    const int64_t first = (b * p.H + h) * ws.nsplit * p.R + r;  // split z at first + z * R
    auto load_parts = [&](float (&part)[kBatch], int64_t z, int64_t count) {
      const float* src = ws.acc + (first + z * p.R) * p.D + e;  // one multiply per batch, not per load
#pragma unroll
      for (int j = 0; j < kBatch; ++j) {
        if (j < count) part[j] = src[0];
        src += split_stride;
      }
    };
    float part[kBatch];
    const int64_t stored = min(int64_t{chunk}, ws.nsplit);
    load_parts(part, 0, min(int64_t{kBatch}, stored));
    float2 mine = e < stored ? ws.ml[first + e * p.R] : make_float2(dm::neg_inf(), 0.0f);
    const int64_t limit = row_keys(p.rows, p.T, p.S, b, row_time(p, r)).limit;
    const int64_t splits = (limit + kSplit - 1) / kSplit;
    float m_tot = dm::neg_inf(), l_tot = 0.0f, acc = 0.0f;  // m_tot: the same in every thread
    for (int64_t z0 = 0; z0 < splits; z0 += chunk) {
      const int n = static_cast<int>(min(int64_t{chunk}, splits - z0));
      if (z0 > 0) {
        load_parts(part, z0, min(kBatch, n));
        if (e < n) mine = ws.ml[first + (z0 + e) * p.R];
      }
      if (e >= n) mine = make_float2(dm::neg_inf(), 0.0f);
      ml[e] = mine;
      float after;
      const float m_before = exclusive_max_nan(mine.x, m_tot, warp_total, &after);
      if (!split_is_empty(mine.x)) {
        const Rescale rs = rescale<FastMath>(m_before, mine.x);
        factors[e] = make_float2(rs.old_scale, rs.in_scale);
      }
      m_tot = after;
      __syncthreads();
      for (int j0 = 0; j0 < n; j0 += kBatch) {
        if (j0 > 0) load_parts(part, z0 + j0, min(kBatch, n - j0));
#pragma unroll
        for (int j = 0; j < kBatch; ++j) {
          if (j0 + j >= n) break;
          const float2 s = ml[j0 + j], f = factors[j0 + j];
          const bool empty = split_is_empty(s.x);  // its factors were not written
          const float l_new = merge_term(l_tot, f.x, s.y, f.y), acc_new = merge_term(acc, f.x, part[j], f.y);
          l_tot = empty ? l_tot : l_new;
          acc = empty ? acc : acc_new;
        }
      }
      __syncthreads();  // the next chunk overwrites the shared values
    }
    store_elem<Storage>(o, q_index(p, b, h, r) + e, finish_out(acc, out_scale(l_tot)));
    if (e == 0) lse2[stat_index(p, b, h, r)] = finish_lse2<FastMath>(m_tot, l_tot);
  }
}

}  // namespace
}  // namespace attn
}  // namespace jaxdet

#include "attention/attention_decode.cuh"
#include "attention/attention_wgmma_fwd.cuh"

namespace jaxdet {
namespace attn {
namespace {

// The opt-in to more than 48 KB of dynamic shared memory. It stays with the kernel on its device,
// so the driver is called only when a launch needs more than the kernel's largest opt-in so far
// (at a decode step's size the handler's host time is what a call costs). The attribute is a
// maximum that a smaller value would lower, so it is only ever raised.
template <class Kernel>
ffi::Error prepare(Kernel kernel, size_t smem, int smem_optin, const char* op) {
  if (smem > static_cast<size_t>(smem_optin)) {
    return ffi::Error::Internal(std::string(op) + ": this GPU has too little shared memory per block (" +
                                std::to_string(smem) + " bytes needed)");
  }
  if (smem <= 48 * 1024) return ffi::Error::Success();
  int device = 0;
  if (cudaError_t status = cudaGetDevice(&device); status != cudaSuccess) return cuda_error(op, status);
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> opted_in;
  std::lock_guard<std::mutex> lock(mutex);
  size_t& largest = opted_in[std::make_pair(reinterpret_cast<const void*>(kernel), device)];
  if (smem <= largest) return ffi::Error::Success();
  const cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (status != cudaSuccess) return cuda_error(op, status);
  largest = smem;
  return ffi::Error::Success();
}

// Whether DecodeSplitKernel<..., true> (`kernel`, its shared-memory opt-in prepared) merges a
// tile's `splits` splits in a cluster on the current device: at most kMaxClusterSplits (the
// portable cluster size; one split is a cluster of one CTA, which finishes its rows itself, with no
// CombineKernel launch after it), and the device runs such a cluster of sm_90 code
// (max_active_clusters: the sm_80 code has no cluster barrier).
// Else CombineKernel merges them: the same bits. JAXDET_TESTING=attention=split_combine forces
// that. Asked once per (device, splits).
template <class Kernel>
bool decode_cluster_merges(Kernel kernel, int splits, int threads, size_t smem) {
  if (splits < 1 || splits > kMaxClusterSplits || attention_testing_is("split_combine")) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  static std::mutex mutex;
  static std::map<std::pair<int, int>, bool> known;
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, splits);
  if (auto it = known.find(key); it != known.end()) return it->second;
  const bool runs =
      max_active_clusters(kernel, device, static_cast<unsigned>(splits), static_cast<unsigned>(threads), smem) > 0;
  known[key] = runs;
  return runs;
}

// A tensor-core kernel's two launches (attention_nonfinite.cuh): `first` over the whole grid, then
// `careful` (its kCareful instance), which recomputes the CTAs the first flagged and returns at
// once in the others.
template <class... Params, class... Args>
ffi::Error launch_twice(void (*first)(Params...), void (*careful)(Params...), dim3 grid, int threads, size_t smem,
                        int smem_optin, const char* op, cudaStream_t stream, Args... args) {
  if (auto err = prepare(first, smem, smem_optin, op); !err.success()) return err;
  if (auto err = prepare(careful, smem, smem_optin, op); !err.success()) return err;
  first<<<grid, threads, smem, stream>>>(args...);
  careful<<<grid, threads, smem, stream>>>(args...);
  return ffi::Error::Success();
}

// The forward's two launches; `fired` holds a flag per CTA of the grid.
template <class Core, int kWarps>
ffi::Error launch_forward_pair(cudaStream_t stream, int* fired, dim3 grid, const Problem& p, void* o, float* lse2,
                               SplitOut ws, int smem_optin) {
  return launch_twice(FwdKernel<Core, kWarps, false>, FwdKernel<Core, kWarps, true>, grid, kWarps * 32,
                      FwdGeom<Core, kWarps>::bytes(ws.nsplit == 0), smem_optin, "jaxdet_attention_fwd", stream, p,
                      o, lse2, ws, fired);
}

template <class Core, int kWarps>
ffi::Error launch_final(cudaStream_t stream, int* fired, const Problem& p, void* o, float* lse2, int smem_optin) {
  using Geo = FwdGeom<Core, kWarps>;
  const dim3 grid(static_cast<unsigned>((p.R + Geo::kRows - 1) / Geo::kRows), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(p.B));
  return launch_forward_pair<Core, kWarps>(stream, fired, grid, p, o, lse2, SplitOut{nullptr, nullptr, 0},
                                           smem_optin);
}

// The Hopper final mode: FwdWsKernel (192-row CTAs, a flag per 64 rows), then FwdKernel's careful
// instance over 64-row CTAs, which reads those flags.
template <class Elem, int D>
ffi::Error launch_final_ws(cudaStream_t stream, int* fired, const Problem& p, void* o, float* lse2,
                           int smem_optin) {
  using Geo = FwdWsGeom<Elem, D>;
  using Careful = FwdGeom<WgmmaCore<Elem, D>, 4>;
  static_assert(Careful::kRows * Geo::kConsumers == Geo::kRows, "a flag per consumer warpgroup");
  const char* op = "jaxdet_attention_fwd";
  const dim3 grid(static_cast<unsigned>((p.R + Geo::kRows - 1) / Geo::kRows), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(p.B));
  const dim3 careful_grid(static_cast<unsigned>((p.R + Careful::kRows - 1) / Careful::kRows), grid.y, grid.z);
  auto first = FwdWsKernel<Elem, D>;
  auto careful = FwdKernel<WgmmaCore<Elem, D>, 4, true>;
  if (auto err = prepare(first, Geo::kBytes, smem_optin, op); !err.success()) return err;
  if (auto err = prepare(careful, Careful::bytes(true), smem_optin, op); !err.success()) return err;
  first<<<grid, Geo::kThreads, Geo::kBytes, stream>>>(p, o, lse2, fired);
  careful<<<careful_grid, 128, Careful::bytes(true), stream>>>(p, o, lse2, SplitOut{nullptr, nullptr, 0}, fired);
  return ffi::Error::Success();
}

// The forward's kernels for the mode forward_workspace chose (attention_workspace.h), in the memory
// it laid out at `ws`.
template <class Elem, int D>
ffi::Error launch_forward_mma(cudaStream_t stream, const ForwardWorkspace& w, unsigned char* ws, const Problem& p,
                              void* o, float* lse2, int smem_optin) {
  using Storage = typename MmaElem<Elem>::Storage;
  int* fired = reinterpret_cast<int*>(ws);
  if (w.nsplit > 0) {
    using Core = MmaSyncCore<Elem, D, 1>;
    const SplitOut split{reinterpret_cast<float*>(ws + w.acc_offset), reinterpret_cast<float2*>(ws + w.ml_offset),
                         w.nsplit};
    const int64_t tiles = (p.R + 15) / 16;
    const dim3 grid(static_cast<unsigned>(tiles * w.nsplit), static_cast<unsigned>(p.H),
                    static_cast<unsigned>(p.B));
    bool decode = false;
    if constexpr (D == 128) {
      // At most a CTA per SM: DecodeSplitKernel's eight warps per split (attention_decode.cuh),
      // which recompute a flagged split themselves and, in clusters, merge the splits too.
      // JAXDET_TESTING=attention=eight_warp_splits runs it on any grid, one_warp_splits on none.
      using Geo = DecodeGeom<Elem, D>;
      const bool fits = int64_t{grid.x} * grid.y * grid.z <= current_sm_count();
      decode = (fits || attention_testing_is("eight_warp_splits")) && !attention_testing_is("one_warp_splits") &&
               Geo::kBytes <= static_cast<size_t>(smem_optin);
      if (decode) {
        const char* op = "jaxdet_attention_fwd";
        auto merging = DecodeSplitKernel<Elem, D, true>;
        if (auto err = prepare(merging, Geo::kBytes, smem_optin, op); !err.success()) return err;
        if (decode_cluster_merges(merging, static_cast<int>(w.nsplit), Geo::kThreads, Geo::kBytes)) {
          cudaLaunchAttribute cluster;
          const cudaLaunchConfig_t cfg = cluster_launch_config(cluster, static_cast<unsigned>(w.nsplit), grid,
                                                               Geo::kThreads, Geo::kBytes, stream);
          cudaLaunchKernelEx(&cfg, merging, p, split, o, lse2);  // an error is left for last_launch_error
          return ffi::Error::Success();
        }
        auto first = DecodeSplitKernel<Elem, D, false>;
        if (auto err = prepare(first, Geo::kBytes, smem_optin, op); !err.success()) return err;
        first<<<grid, Geo::kThreads, Geo::kBytes, stream>>>(p, split, o, lse2);
      }
    }
    if (!decode) {
      auto err = launch_forward_pair<Core, 1>(stream, fired, grid, p, o, lse2, split, smem_optin);
      if (!err.success()) return err;
    }
    CombineKernel<Storage><<<grid_for(p.B * p.H * p.R, 1), D, 0, stream>>>(p, split, o, lse2);  // a CTA per row
    return ffi::Error::Success();
  }
  if constexpr (D == 64 || D == 128) {
    // Hopper: a warpgroup of 4 warps issues wgmma for 64 rows (the same bits, attention_wgmma.cuh).
    using Wgmma = WgmmaCore<Elem, D>;
    if (wgmma_enabled() && FwdGeom<Wgmma, 4>::bytes(true) <= static_cast<size_t>(smem_optin)) {
      if (warp_specialized_forward_enabled() && FwdWsGeom<Elem, D>::kBytes <= static_cast<size_t>(smem_optin)) {
        return launch_final_ws<Elem, D>(stream, fired, p, o, lse2, smem_optin);
      }
      return launch_final<Wgmma, 4>(stream, fired, p, o, lse2, smem_optin);
    }
  }
  if constexpr (D == 64) {
    // Two row groups per warp: each K/V fragment read from shared memory feeds 32 rows. (At head
    // dimension 128 the two groups' accumulators do not fit in registers without spilling.)
    if (p.R > 64 && FwdGeom<MmaSyncCore<Elem, D, 2>, 4>::bytes(true) <= static_cast<size_t>(smem_optin)) {
      return launch_final<MmaSyncCore<Elem, D, 2>, 4>(stream, fired, p, o, lse2, smem_optin);
    }
  }
  if constexpr (D <= 128) {  // 4-warp tiles fit in shared memory
    if (FwdGeom<MmaSyncCore<Elem, D, 1>, 4>::bytes(true) <= static_cast<size_t>(smem_optin)) {
      return launch_final<MmaSyncCore<Elem, D, 1>, 4>(stream, fired, p, o, lse2, smem_optin);
    }
  }
  return launch_final<MmaSyncCore<Elem, D, 1>, 1>(stream, fired, p, o, lse2, smem_optin);
}

// ---- Backward. ----

// dQ: the rows of the forward, each over its visible keys in ascending blocks:
//   p = exp2(x - lse2), dp = do . v (an MMA chain like the scores), ds = p * (dp - delta),
//   dq += ds . K (an MMA chain over the block's keys), dq * scale at the end.
template <class Core, int kWarps>
struct DqGeom {
  static constexpr int D = Core::D;
  static constexpr int kRows = 16 * kWarps;
  static constexpr size_t kQ = Core::query_tile_bytes(kRows);  // Q or dO
  static constexpr size_t kKV = 2 * Core::kTile;               // K or V, two stages
  static constexpr size_t kRowInfo = size_t{2} * kRows * sizeof(int);
  static constexpr size_t kCols = NonFiniteCols<D>::kBytes;  // of the K tile
  static constexpr size_t bytes() { return 2 * kQ + 2 * kKV + kRowInfo + kCols; }
};

// ds = p * (dp - delta) with p = exp2(x - lse2) for the keys of block blk a row sees, 0 for the
// others; kMasked false when every key of the block is visible to the rows (the same bits).
template <bool kMasked>
__device__ __forceinline__ void dq_terms(float (&s)[8][4], const float (&dp)[8][4], int blk, const int (&lim)[2],
                                         const float (&lse)[2], const float (&delta)[2], float c, int q4) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int rr = i >> 1;
      const bool visible = !kMasked || blk * kBlock + nt * 8 + 2 * q4 + (i & 1) < lim[rr];
      const float pr = visible ? FastMath::exp2(dm::sub(dm::mul(s[nt][i], c), lse[rr])) : 0.0f;
      s[nt][i] = visible ? dm::mul(pr, dm::sub(dp[nt][i], delta[rr])) : 0.0f;
    }
  }
}

// A CTA: kWarps warps of 16 rows, the products on Core (MmaSyncCore<Elem, D, 1>, or WgmmaCore: the
// same bits, attention_wgmma.cuh): s by a core on the Q tile, dp by one on the dO tile, dq += ds . K
// as the forward's P.V with K in V's place.
template <class Core, int kWarps, bool kCareful>
__global__ void __launch_bounds__(kWarps * 32) DqKernel(Problem p, BackwardOut out) {
  using Elem = typename Core::Elem;
  using Geo = DqGeom<Core, kWarps>;
  using Storage = typename MmaElem<Elem>::Storage;
  constexpr int D = Core::D, kRows = Geo::kRows, kThreads = kWarps * 32;
  constexpr size_t kTileElems = Core::kTile / sizeof(Elem);
  extern __shared__ __align__(1024) unsigned char smem[];  // as FwdKernel declares it
  Elem* Qs = reinterpret_cast<Elem*>(smem);
  Elem* dOs = reinterpret_cast<Elem*>(smem + Geo::kQ);
  Elem* Ks = reinterpret_cast<Elem*>(smem + 2 * Geo::kQ);
  Elem* Vs = reinterpret_cast<Elem*>(smem + 2 * Geo::kQ + Geo::kKV);
  PassRows rows{reinterpret_cast<int*>(smem + 2 * Geo::kQ + 2 * Geo::kKV), nullptr};
  rows.limit = rows.start + kRows;
  const NonFiniteCols<D> k_cols(smem + 2 * Geo::kQ + 2 * Geo::kKV + Geo::kRowInfo);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, q4 = lane & 3;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int64_t r0 = int64_t{blockIdx.x} * kRows;
  const Elem* q = static_cast<const Elem*>(p.q);
  const Elem* k = static_cast<const Elem*>(p.k);
  const Elem* v = static_cast<const Elem*>(p.v);
  const Elem* dout = static_cast<const Elem*>(out.dout);
  const int64_t kv_stride = p.H * p.D;  // elements between consecutive key positions
  if constexpr (kCareful) {
    if (out.dq_fired[cta_index()] == 0) return;  // the first launch's rows stand
  }

  load_row_info<kRows, kThreads>(p, b, r0, rows);
  load_query_tile<Elem, D, kThreads, kRows, typename Core::QueryChunks>(Qs, q, p, b, h, r0);
  load_query_tile<Elem, D, kThreads, kRows, typename Core::QueryChunks>(dOs, dout, p, b, h, r0);
  cp_async_commit();
  const int row_local[2] = {warp * 16 + grp, warp * 16 + grp + 8};
  float lse[2], delta[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t r = r0 + row_local[rr];
    lse[rr] = r < p.R ? out.lse2[stat_index(p, b, h, r)] : 0.0f;
    delta[rr] = r < p.R ? out.delta[stat_index(p, b, h, r)] : 0.0f;
  }
  if constexpr (kCareful) k_cols.template clear<kThreads>();
  cp_async_wait<0>();
  Core::tiles_written();
  __syncthreads();

  Core q_core(Qs, warp, lane, p), do_core(dOs, warp, lane, p);
  float dq[1][D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) dq[0][dt][0] = dq[0][dt][1] = dq[0][dt][2] = dq[0][dt][3] = 0.0f;

  int cur = -1, plimit = 0;
  while ((cur = next_pass<kRows>(rows, cur, &plimit)) != INT_MAX) {
    const int lim[2] = {rows.start[row_local[0]] == cur ? rows.limit[row_local[0]] : 0,
                        rows.start[row_local[1]] == cur ? rows.limit[row_local[1]] : 0};
    const int nblocks = (plimit + kBlock - 1) / kBlock;
    if (nblocks == 0) continue;
    const int pass_start = cur, pass_limit = plimit;
    auto load_kv = [&](int stage, int blk) {
      const int pos0 = blk * kBlock;
      const int64_t first = kv_index(p, b, h, pass_start + pos0);
      Core::template load_tile<kThreads>(Ks + stage * kTileElems, k + first, kv_stride, pass_limit - pos0, k);
      Core::template load_tile<kThreads>(Vs + stage * kTileElems, v + first, kv_stride, pass_limit - pos0, v);
      cp_async_commit();
    };
    load_kv(0, 0);
    for (int blk = 0; blk < nblocks; ++blk) {
      const int stage = blk & 1;
      if (blk + 1 < nblocks) {
        load_kv(stage ^ 1, blk + 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      Core::tiles_written();
      Elem* Kb = Ks + stage * kTileElems;
      // K(blk) and V(blk) are in; kCareful: whether K(blk) holds an inf or NaN.
      bool k_nonfinite = false;
      if constexpr (kCareful) {
        k_nonfinite =
            __syncthreads_or(own_chunks_nonfinite<Elem, D, kThreads, kBlock>(Kb, typename Core::Chunks{}, p.zero));
      } else {
        __syncthreads();
      }
      float s[1][8][4], dp[1][8][4];
      q_core.scores(Kb, s);
      do_core.scores(Vs + stage * kTileElems, dp);
      if (__all_sync(kFullMask, (blk + 1) * kBlock <= min(lim[0], lim[1]))) {
        dq_terms<false>(s[0], dp[0], blk, lim, lse, delta, p.c, q4);  // every key visible to the warp's rows
      } else {
        dq_terms<true>(s[0], dp[0], blk, lim, lse, delta, p.c, q4);
      }
      if (k_nonfinite) {
        __syncthreads();  // every warp is done with the scores
        clean_own_chunks<Elem, D, kThreads, kBlock>(Kb, typename Core::Chunks{}, k_cols);
        Core::tiles_written();
        __syncthreads();
      }
      q_core.pv(s, Kb, dq);
      if (k_nonfinite) {
        const auto visible = [&](int nt, int i) { return blk * kBlock + nt * 8 + 2 * q4 + (i & 1) < lim[i >> 1]; };
        add_nonfinite_terms<Elem, D>(s[0], visible, k_cols, dq[0], lane);
      }
      __syncthreads();
      if (k_nonfinite) k_cols.template clear<kThreads>();
    }
  }
  using Bits = typename Storage::Bits;
  bool stored_nonfinite = false;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t r = r0 + row_local[rr];
    if (r >= p.R) continue;
    Bits* dst = static_cast<Bits*>(out.dq) + q_index(p, b, h, r);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      stored_nonfinite |=
          store_pair<Elem>(dst + dt * 8 + 2 * q4, Storage::store(dm::mul(dq[0][dt][2 * rr], out.scale)),
                           Storage::store(dm::mul(dq[0][dt][2 * rr + 1], out.scale)));
    }
  }
  if constexpr (!kCareful) {
    // A K tile held an inf or NaN (or a row's own terms made one; dq only accumulates, so it is
    // still there, and row r0 is always stored): the kCareful launch writes this CTA's rows again
    // (attention_nonfinite.cuh).
    const bool any_fired = __syncthreads_or(stored_nonfinite);
    if (threadIdx.x == 0) out.dq_fired[cta_index()] = any_fired ? 1 : 0;
  }
}

// Per batch element, per tile of 64 query rows: the memory rows of keys any of its rows may see,
// [lo, hi) (lo = INT_MAX, hi = 0 when none). dK/dV skip the tiles whose range misses their keys.
constexpr int kQueryTile = 64;

__global__ void __launch_bounds__(256) TileRangeKernel(Problem p, int2* ranges, int64_t tiles) {
  const int64_t n = p.B * tiles;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / tiles, tile = i % tiles;
    int lo = INT_MAX, hi = 0;
    const int64_t r_end = min(p.R, (tile + 1) * kQueryTile);
    for (int64_t r = tile * kQueryTile; r < r_end; r += (r % p.G == 0 ? p.G : 1)) {
      const RowKeys k = row_keys(p.rows, p.T, p.S, b, row_time(p, r));
      if (k.limit == 0) continue;
      lo = min(lo, static_cast<int>(k.start));
      hi = max(hi, static_cast<int>(k.start + k.limit));
    }
    ranges[i] = make_int2(lo, hi);
  }
}

// dK/dV: a CTA owns 64 keys (16 per warp) of one (b, h) and walks the query-row tiles of b in
// ascending order, skipping tiles none of whose rows sees its keys:
//   p^T = exp2(x - lse2), dp^T = v . do, ds^T = p^T * (dp^T - delta),
//   dv += p^T . dO and dk += ds^T . Q (MMA chains over the tile's rows in ascending 16-row steps).
// kWhich: 3 both, 1 dK only, 2 dV only (head dimension 256, whose two accumulators do not fit in
// registers together).
template <class Core, int kStages>
struct DkdvGeom {
  static constexpr int D = Core::D;
  static constexpr size_t kKV = Core::kTile;                                          // K or V
  static constexpr size_t kQ = kStages * Core::query_tile_bytes(kQueryTile);          // Q or dO
  static constexpr size_t kRowInfo = size_t{kStages} * kQueryTile * (2 * sizeof(int) + 2 * sizeof(float));
  static constexpr size_t kCols = NonFiniteCols<D>::kBytes;  // of the Q tile, then of the dO tile
  static constexpr size_t kFlags = 4 * sizeof(unsigned);     // per warp: its chunks' non-finite tiles
  static constexpr size_t bytes() { return 2 * kKV + 2 * kQ + kRowInfo + 2 * kCols + kFlags; }
};

// p^T and ds^T = p^T * (dp^T - delta) of the lane's keys (j, j + 8) against the tile's rows: 0
// where a row does not see the key; kMasked false when every row sees every key (the same bits).
template <bool kDk, bool kMasked>
__device__ __forceinline__ void dkdv_terms(float (&st)[8][4], float (&dpt)[8][4], const int* ts, const int* tl,
                                           const float* tlse, const float* tdelta, int j_lane, float c, int q4) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = j_lane + 8 * (i >> 1);
      const int row = nt * 8 + 2 * q4 + (i & 1);
      const bool visible = !kMasked || (ts[row] <= j && j - ts[row] < tl[row]);
      const float pr = visible ? FastMath::exp2(dm::sub(dm::mul(st[nt][i], c), tlse[row])) : 0.0f;
      if (kDk) dpt[nt][i] = visible ? dm::mul(pr, dm::sub(dpt[nt][i], tdelta[row])) : 0.0f;
      st[nt][i] = pr;
    }
  }
}

// A CTA: 4 warps of 16 keys, the products on Core (MmaSyncCore<Elem, D, 1>, or WgmmaCore: the same
// bits, attention_wgmma.cuh) with the keys in the query rows' place: s^T by a core on the K tile,
// dp^T by one on the V tile, dv += p^T . dO and dk += ds^T . Q as the forward's P.V.
template <class Core, int kWhich, int kStages, bool kCareful>
__global__ void __launch_bounds__(128) DkdvKernel(Problem p, BackwardOut out, const int2* ranges, int64_t tiles) {
  using Elem = typename Core::Elem;
  using Geo = DkdvGeom<Core, kStages>;
  using Storage = typename MmaElem<Elem>::Storage;
  constexpr int D = Core::D, kThreads = 128;
  constexpr size_t kQueryTileElems = Core::query_tile_bytes(kQueryTile) / sizeof(Elem);
  constexpr bool kDk = (kWhich & 1) != 0, kDv = (kWhich & 2) != 0;
  extern __shared__ __align__(1024) unsigned char smem[];  // as FwdKernel declares it
  Elem* Ks = reinterpret_cast<Elem*>(smem);
  Elem* Vs = reinterpret_cast<Elem*>(smem + Geo::kKV);
  Elem* Qs = reinterpret_cast<Elem*>(smem + 2 * Geo::kKV);
  Elem* dOs = reinterpret_cast<Elem*>(smem + 2 * Geo::kKV + Geo::kQ);
  int* rstart = reinterpret_cast<int*>(smem + 2 * Geo::kKV + 2 * Geo::kQ);
  int* rlimit = rstart + kStages * kQueryTile;
  float* rlse = reinterpret_cast<float*>(rlimit + kStages * kQueryTile);
  float* rdelta = rlse + kStages * kQueryTile;
  unsigned char* cols_base = smem + 2 * Geo::kKV + 2 * Geo::kQ + Geo::kRowInfo;
  const NonFiniteCols<D> q_cols(cols_base), do_cols(cols_base + Geo::kCols);
  unsigned* warp_flags = reinterpret_cast<unsigned*>(cols_base + 2 * Geo::kCols);
  if constexpr (kCareful) {
    q_cols.template clear<kThreads>();
    do_cols.template clear<kThreads>();
  }

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, q4 = lane & 3;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  const int j0 = static_cast<int>(blockIdx.x) * kBlock;
  const int j_end = static_cast<int>(min(static_cast<int64_t>(j0 + kBlock), p.S));
  const Elem* q = static_cast<const Elem*>(p.q);
  const Elem* k = static_cast<const Elem*>(p.k);
  const Elem* v = static_cast<const Elem*>(p.v);
  const Elem* dout = static_cast<const Elem*>(out.dout);
  const int2* my_ranges = ranges + b * tiles;
  if constexpr (kCareful) {
    if (out.dkdv_fired[cta_index()] == 0) return;  // the first launch's keys stand
  }

  Core::template load_tile<kThreads>(Ks, k + kv_index(p, b, h, j0), p.H * p.D, static_cast<int>(p.S - j0), k);
  Core::template load_tile<kThreads>(Vs, v + kv_index(p, b, h, j0), p.H * p.D, static_cast<int>(p.S - j0), v);
  cp_async_commit();

  // The next tile at or after `from` whose key range meets [j0, j_end): the same on every thread.
  auto next_tile = [&](int64_t from) -> int64_t {
    for (int64_t base = from; base < tiles; base += 32) {
      bool hit = false;
      if (base + lane < tiles) {
        const int2 rg = my_ranges[base + lane];
        hit = rg.x < j_end && rg.y > j0;
      }
      const unsigned mask = __ballot_sync(kFullMask, hit);
      if (mask) return base + __ffs(mask) - 1;
    }
    return tiles;
  };
  int full_bits = 0;  // bit s: this thread's row of the tile in stage s sees every key of the CTA
  auto load_rows = [&](int stage, int64_t tile) {
    const int64_t r0 = tile * kQueryTile;
    load_query_tile<Elem, D, kThreads, kQueryTile, typename Core::QueryChunks>(Qs + stage * kQueryTileElems, q, p,
                                                                               b, h, r0);
    load_query_tile<Elem, D, kThreads, kQueryTile, typename Core::QueryChunks>(dOs + stage * kQueryTileElems, dout,
                                                                               p, b, h, r0);
    cp_async_commit();
    static_assert(kQueryTile <= kThreads, "one row per thread");
    bool sees_all = true;  // this thread's row sees every key of the CTA
    if (threadIdx.x < kQueryTile) {
      const int i = threadIdx.x;
      const int64_t r = r0 + i;
      const int s = stage * kQueryTile + i;
      if (r < p.R) {
        const RowKeys rk = row_keys(p.rows, p.T, p.S, b, row_time(p, r));
        rstart[s] = static_cast<int>(rk.start);
        rlimit[s] = static_cast<int>(rk.limit);
        rlse[s] = out.lse2[stat_index(p, b, h, r)];
        rdelta[s] = out.delta[stat_index(p, b, h, r)];
        sees_all = rk.start <= j0 && j0 + kBlock - 1 - rk.start < rk.limit;
      } else {
        rstart[s] = INT_MAX;
        rlimit[s] = 0;
        rlse[s] = 0.0f;
        rdelta[s] = 0.0f;
        sees_all = false;
      }
    }
    full_bits = sees_all ? full_bits | (1 << stage) : full_bits & ~(1 << stage);
  };

  float dk[1][D / 8][4], dv[1][D / 8][4];
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) dk[0][dt][i] = dv[0][dt][i] = 0.0f;
  }
  Core k_core(Ks, warp, lane, p), v_core(Vs, warp, lane, p);
  int64_t tile = next_tile(0);
  int stage = 0;
  if (tile < tiles) load_rows(0, tile);
  while (tile < tiles) {
    const int64_t next = next_tile(tile + 1);
    if (kStages == 2 && next < tiles) {
      load_rows(stage ^ 1, next);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    Core::tiles_written();
    Elem* Qt = Qs + stage * kQueryTileElems;
    Elem* dOt = dOs + stage * kQueryTileElems;
    using QueryChunks = typename Core::QueryChunks;
    if constexpr (kCareful) {
      // Which of the tile's Q (bit 0) and dO (bit 1) hold an inf or NaN, published per warp with
      // the barrier below.
      const unsigned mine =
          (own_chunks_nonfinite<Elem, D, kThreads, kQueryTile>(Qt, QueryChunks{}, p.zero) ? 1u : 0u) |
          (own_chunks_nonfinite<Elem, D, kThreads, kQueryTile>(dOt, QueryChunks{}, p.zero) ? 2u : 0u);
      const unsigned warp_mine = __reduce_or_sync(kFullMask, mine);
      if (lane == 0) warp_flags[warp] = warp_mine;
    }
    // Every row of the tile sees every key of the CTA: no visibility test per term (same bits).
    const bool all_visible = __syncthreads_and((full_bits >> stage) & 1);
    const unsigned nonfinite = kCareful ? warp_flags[0] | warp_flags[1] | warp_flags[2] | warp_flags[3] : 0u;
    const int* ts = rstart + stage * kQueryTile;
    const int* tl = rlimit + stage * kQueryTile;
    float st[1][8][4], dpt[1][8][4];
    k_core.scores(Qt, st);
    if (kDk) v_core.scores(dOt, dpt);
    const float* tlse = rlse + stage * kQueryTile;
    const float* tdelta = rdelta + stage * kQueryTile;
    if (all_visible) {
      dkdv_terms<kDk, false>(st[0], dpt[0], ts, tl, tlse, tdelta, j0 + warp * 16 + grp, p.c, q4);
    } else {
      dkdv_terms<kDk, true>(st[0], dpt[0], ts, tl, tlse, tdelta, j0 + warp * 16 + grp, p.c, q4);
    }
    if (nonfinite) {
      __syncthreads();  // every warp is done with the products of the original tiles
      if (nonfinite & 1) clean_own_chunks<Elem, D, kThreads, kQueryTile>(Qt, QueryChunks{}, q_cols);
      if (nonfinite & 2) clean_own_chunks<Elem, D, kThreads, kQueryTile>(dOt, QueryChunks{}, do_cols);
      Core::tiles_written();
      __syncthreads();
    }
    if (kDv) k_core.pv(st, dOt, dv);
    if (kDk) k_core.pv(dpt, Qt, dk);
    if (nonfinite) {
      const int j_lane = j0 + warp * 16 + grp;
      const auto visible = [&](int nt, int i) {
        const int row = nt * 8 + 2 * q4 + (i & 1), j = j_lane + 8 * (i >> 1);
        return ts[row] <= j && j - ts[row] < tl[row];
      };
      if (kDv && (nonfinite & 2)) add_nonfinite_terms<Elem, D>(st[0], visible, do_cols, dv[0], lane);
      if (kDk && (nonfinite & 1)) add_nonfinite_terms<Elem, D>(dpt[0], visible, q_cols, dk[0], lane);
    }
    __syncthreads();
    if (nonfinite) {
      q_cols.template clear<kThreads>();
      do_cols.template clear<kThreads>();
    }
    if (kStages == 1 && next < tiles) load_rows(0, next);
    tile = next;
    if (kStages == 2) stage ^= 1;
  }
  cp_async_wait<0>();  // the K/V group when no tile was visible

  using Bits = typename Storage::Bits;
  bool stored_nonfinite = false;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int j = j0 + warp * 16 + grp + 8 * rr;
    if (j >= p.S) continue;
    const int64_t off = kv_index(p, b, h, j);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      if (kDk) {
        stored_nonfinite |= store_pair<Elem>(static_cast<Bits*>(out.dk) + off + dt * 8 + 2 * q4,
                                             Storage::store(dm::mul(dk[0][dt][2 * rr], out.scale)),
                                             Storage::store(dm::mul(dk[0][dt][2 * rr + 1], out.scale)));
      }
      if (kDv) {
        stored_nonfinite |=
            store_pair<Elem>(static_cast<Bits*>(out.dv) + off + dt * 8 + 2 * q4, Storage::store(dv[0][dt][2 * rr]),
                             Storage::store(dv[0][dt][2 * rr + 1]));
      }
    }
  }
  if constexpr (!kCareful) {
    // A Q or dO tile held an inf or NaN (or a key's own terms made one; dk and dv only accumulate,
    // and key j0 is always stored): the kCareful launch writes this CTA's keys again
    // (attention_nonfinite.cuh).
    const bool any_fired = __syncthreads_or(stored_nonfinite);
    if (threadIdx.x == 0) out.dkdv_fired[cta_index()] = any_fired ? 1 : 0;
  }
}

template <class Core, int kWhich, int kStages>
ffi::Error launch_dkdv(cudaStream_t stream, const Problem& p, const BackwardOut& out, int smem_optin) {
  const dim3 grid(static_cast<unsigned>((p.S + kBlock - 1) / kBlock), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(p.B));
  return launch_twice(DkdvKernel<Core, kWhich, kStages, false>, DkdvKernel<Core, kWhich, kStages, true>, grid, 128,
                      DkdvGeom<Core, kStages>::bytes(), smem_optin, "jaxdet_attention_bwd", stream, p, out,
                      static_cast<const int2*>(out.tile_ranges), out.query_tiles);
}

template <class Core, int kWarps>
ffi::Error launch_dq(cudaStream_t stream, const Problem& p, const BackwardOut& out, int smem_optin) {
  using Geo = DqGeom<Core, kWarps>;
  const dim3 grid(static_cast<unsigned>((p.R + Geo::kRows - 1) / Geo::kRows), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(p.B));
  return launch_twice(DqKernel<Core, kWarps, false>, DqKernel<Core, kWarps, true>, grid, kWarps * 32, Geo::bytes(),
                      smem_optin, "jaxdet_attention_bwd", stream, p, out);
}

// Hopper (as the forward): the dQ and dK/dV products on wgmma at head dimensions 64 and 128.
template <class Elem, int D>
ffi::Error launch_backward_mma(cudaStream_t stream, const Problem& p, const BackwardOut& out, int smem_optin) {
  using Storage = typename MmaElem<Elem>::Storage;
  using Mma = MmaSyncCore<Elem, D, 1>;
  bool wgmma = false;
  if constexpr (D == 64 || D == 128) {
    wgmma = wgmma_enabled() && DqGeom<WgmmaCore<Elem, D>, 4>::bytes() <= static_cast<size_t>(smem_optin) &&
            DkdvGeom<WgmmaCore<Elem, D>, 2>::bytes() <= static_cast<size_t>(smem_optin);
  }
  if (p.B * p.H * p.R > 0) {
    launch_delta<Storage>(stream, p, out);
    ffi::Error err = ffi::Error::Success();
    if constexpr (D == 64 || D == 128) {
      err = wgmma ? launch_dq<WgmmaCore<Elem, D>, 4>(stream, p, out, smem_optin)
                  : launch_dq<Mma, 4>(stream, p, out, smem_optin);
    } else {
      err = launch_dq<Mma, 1>(stream, p, out, smem_optin);
    }
    if (!err.success()) return err;
    TileRangeKernel<<<grid_for(p.B * out.query_tiles, 256), 256, 0, stream>>>(p, out.tile_ranges, out.query_tiles);
  }
  if (p.B * p.H * p.S == 0) return ffi::Error::Success();
  if constexpr (D == 64 || D == 128) {
    return wgmma ? launch_dkdv<WgmmaCore<Elem, D>, 3, 2>(stream, p, out, smem_optin)
                 : launch_dkdv<Mma, 3, 2>(stream, p, out, smem_optin);
  } else {
    if (auto err = launch_dkdv<Mma, 1, 1>(stream, p, out, smem_optin); !err.success()) return err;
    return launch_dkdv<Mma, 2, 1>(stream, p, out, smem_optin);
  }
}

}  // namespace
}  // namespace attn
}  // namespace jaxdet
