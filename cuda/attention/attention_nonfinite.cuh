// Non-finite elements in the shared-memory tiles of jaxdet.attention's tensor-core kernels.
// Included by attention_mma.cuh.
//
// A tile's MMA (P.V in the forward; dS.K, P^T.dO and dS^T.Q in the backward) multiplies each of its
// rows j by every A row's coefficient, and that coefficient is exactly 0 where the A row does not
// see j (a later position, another segment); 0 x inf = NaN. Which rows a tile holds besides the
// ones an A row sees depends on the call (chunk boundaries, the CTA's rows, the cache length), so
// such a NaN would break prefill/decode invariance. Hence each tensor-core kernel runs twice:
//
// * The first launch does not look at its tiles. Each thread probes its accumulators before they
//   are reset (probe_nonfinite) or as it stores them (pair_nonfinite): an inf or NaN in a tile
//   reaches every row's accumulator in its column and stays there (sums and rescales keep it), so
//   a CTA whose tiles hold one always sees it (and one whose rows make an inf themselves too).
//   Such a CTA sets its flag, which sends its rows to the second launch; the others clear it.
// * The kCareful launch returns at once in the CTAs whose flag is clear and recomputes the others:
//   the CTA votes, at the barrier that publishes a tile, whether its loaded elements hold an inf or
//   NaN (each thread checks the 16-byte chunks it copied), and such a tile is cleaned before its
//   MMA: its non-finite elements become +0 and their places go to per-column bit masks
//   (NonFiniteCols). After the MMA each output element adds the terms the MMA left out, from its
//   A row's visible coefficients only (add_nonfinite_terms).
//
// A row's bits so depend on what it sees only: a tile without an inf or NaN is not changed by the
// cleaning (its masks stay empty), so a tile whose non-finite elements a row does not see gives
// the row the same bits cleaned or not, and the first launch's rows are the careful launch's; a
// tile with one the row sees is cleaned in every call. The left-out terms are infinite or NaN, so
// their sum is the same in any order: NaN if one is NaN or two are infinite with opposite signs,
// else the one signed infinity.
#pragma once

#include <type_traits>

namespace jaxdet {
namespace attn {
namespace {

// The CTA's index in its grid, for the flags of the first launch.
__device__ __forceinline__ int64_t cta_index() {
  return blockIdx.x + int64_t{gridDim.x} * (blockIdx.y + int64_t{gridDim.y} * blockIdx.z);
}

// The 16-byte chunks a thread copies into a tile of kRows rows of D elements (load_rows_tile,
// load_query_tile and WgmmaCore::load_tile all copy these): column chunk c = tid % (D / 8) of the
// rows tid / (D / 8) + n * kStep. f(row, c) for each; kUnroll false keeps a rare path's loop out
// of the register allocation of the kernels' main loops.
template <int D, int kThreads, int kRows, bool kUnroll = true, class F>
__device__ __forceinline__ void for_own_chunks(F&& f) {
  constexpr int kChunks = D / 8, kStep = kThreads / kChunks;
  static_assert(kThreads % kChunks == 0 && kRows % kStep == 0, "whole rows per pass of the threads");
  const int i0 = static_cast<int>(threadIdx.x) / kChunks, c = static_cast<int>(threadIdx.x) % kChunks;
  if constexpr (kUnroll) {
#pragma unroll
    for (int n = 0; n < kRows / kStep; ++n) f(i0 + n * kStep, c);
  } else {
#pragma unroll 1
    for (int n = 0; n < kRows / kStep; ++n) f(i0 + n * kStep, c);
  }
}

// Whether an Elem (its bits) is inf or NaN: every exponent bit set.
template <class Elem>
__device__ __forceinline__ bool elem_nonfinite(uint32_t bits) {
  constexpr uint32_t kExp = MmaElem<Elem>::kExponentBits;
  return (bits & kExp) == kExp;
}

// Bit j of pos[d] (neg[d]): element (j, d) of the tile was +inf (-inf) or NaN before cleaning. A NaN
// sets both, which gives the right left-out term: any coefficient times it is NaN, as a +inf and
// a -inf term sum to NaN.
template <int D>
struct NonFiniteCols {
  unsigned long long* pos;
  unsigned long long* neg;
  static constexpr size_t kBytes = size_t{2} * D * sizeof(unsigned long long);
  __device__ __forceinline__ explicit NonFiniteCols(void* smem)
      : pos(static_cast<unsigned long long*>(smem)), neg(static_cast<unsigned long long*>(smem) + D) {}

  // Empty masks; the next writer must be behind a barrier.
  template <int kThreads>
  __device__ __forceinline__ void clear() const {
    for (int d = static_cast<int>(threadIdx.x); d < D; d += kThreads) pos[d] = neg[d] = 0;
  }
};

// Whether an accumulator element of row grp (one of the thread's two rows) is inf or NaN: x * 0 is
// NaN exactly for those. An inf or NaN in a tile's row j reaches every A row's product in its
// column (p x inf = inf, 0 x inf = NaN, sums and rescales keep it), so with each lane probing its
// columns of one row the warp sees every column; `zero` is Problem::zero.
template <int D>
__device__ __forceinline__ bool probe_nonfinite(const float (&acc)[D / 8][4], float zero) {
  float t[4] = {zero, zero, zero, zero};
#pragma unroll
  for (int dt = 0; dt < D / 8; ++dt) {
    t[(2 * dt) % 4] = fmaf(acc[dt][0], zero, t[(2 * dt) % 4]);
    t[(2 * dt + 1) % 4] = fmaf(acc[dt][1], zero, t[(2 * dt + 1) % 4]);
  }
  const float u = (t[0] + t[1]) + (t[2] + t[3]);
  return u != u;
}

// Whether either half of a stored pair of Elem is inf or NaN. An accumulator that is inf or NaN
// stores as one (a finite one that rounds to inf only adds a needless second pass).
template <class Elem>
__device__ __forceinline__ bool pair_nonfinite(uint32_t pair) {
  return elem_nonfinite<Elem>(pair) || elem_nonfinite<Elem>(pair >> 16);
}

// Stores two outputs as a pair of Elem (lo at dst[0]); whether either is inf or NaN, which is how
// the backward's first launch finds the non-finite accumulators it was writing.
template <class Elem, class Bits>
__device__ __forceinline__ bool store_pair(Bits* dst, Bits lo, Bits hi) {
  const uint32_t pair = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  *reinterpret_cast<uint32_t*>(dst) = pair;
  return pair_nonfinite<Elem>(pair);
}

// Whether the chunks this thread copied into `tile` (its cp.async group complete) hold an inf or
// NaN: x * 0 is NaN exactly for those, and a NaN stays in the running sum. `zero` is Problem::zero
// (a +0 the compiler cannot see).
template <class Elem, int D, int kThreads, int kRows, class At>
__device__ __forceinline__ bool own_chunks_nonfinite(const Elem* tile, At at, float zero) {
  using Pair = std::conditional_t<std::is_same_v<Elem, __nv_bfloat16>, __nv_bfloat162, __half2>;
  Pair z, t[4];
  if constexpr (std::is_same_v<Elem, __nv_bfloat16>) {
    z = __float2bfloat162_rn(zero);
  } else {
    z = __float2half2_rn(zero);
  }
  t[0] = t[1] = t[2] = t[3] = z;
  for_own_chunks<D, kThreads, kRows>([&](int row, int c) {
    const uint4 x = *reinterpret_cast<const uint4*>(at(tile, row, c));
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] = __hfma2(*reinterpret_cast<const Pair*>(&w[i]), z, t[i]);
  });
  const Pair u = __hadd2(__hadd2(t[0], t[1]), __hadd2(t[2], t[3]));
  const float lo = __low2float(u), hi = __high2float(u);
  return lo != lo || hi != hi;
}

// Replaces the non-finite elements of this thread's chunks by +0 and records them in `cols`
// (empty before, for the tile's rows 0 .. kRows - 1). A rare path: its loops are not unrolled.
template <class Elem, int D, int kThreads, int kRows, class At>
__device__ __forceinline__ void clean_own_chunks(Elem* tile, At at, NonFiniteCols<D> cols) {
  static_assert(kRows <= 64, "a tile row per mask bit");
  for_own_chunks<D, kThreads, kRows, false>([&](int row, int c) {
    uint16_t* e = reinterpret_cast<uint16_t*>(at(tile, row, c));
#pragma unroll 1
    for (int i = 0; i < 8; ++i) {
      const uint16_t bits = e[i];
      if (!elem_nonfinite<Elem>(bits)) continue;
      const bool nan = (bits & 0x7fff) != MmaElem<Elem>::kExponentBits, neg = (bits & 0x8000) != 0;
      const unsigned long long bit = 1ull << row;
      if (nan || !neg) atomicOr(&cols.pos[c * 8 + i], bit);
      if (nan || neg) atomicOr(&cols.neg[c * 8 + i], bit);
      e[i] = 0;
    }
  });
}

// acc += the terms x . M that the MMA on the cleaned tile M left out, for the warp's 16 A rows (x
// and acc in the mma.sync fragment layouts: A element x[nt][i] is row grp + 8 (i >> 1), tile row
// 8 nt + 2 q4 + (i & 1); acc[dt][i] is column 8 dt + 2 q4 + (i & 1)). visible(nt, i): whether the A
// row sees that tile row; the coefficient is x rounded to Elem, as the MMA takes it.
template <class Elem, int D, class Visible>
__device__ __forceinline__ void add_nonfinite_terms(const float (&x)[8][4], Visible visible, NonFiniteCols<D> cols,
                                                    float (&acc)[D / 8][4], int lane) {
  constexpr uint32_t kExp = MmaElem<Elem>::kExponentBits;
  const int q4 = lane & 3;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    // The visible tile rows by the sign of their coefficient; `zero` also holds NaN coefficients
    // (times an infinity: NaN, as 0 x inf).
    unsigned long long positive = 0, negative = 0, zero = 0;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 2 * rr + e;
        if (!visible(nt, i)) continue;
        const uint32_t bits = MmaElem<Elem>::pack(x[nt][i], 0.0f) & 0xffffu;
        const uint32_t magnitude = bits & 0x7fffu;
        const unsigned long long bit = 1ull << (nt * 8 + 2 * q4 + e);
        if (magnitude == 0 || magnitude > kExp) {
          zero |= bit;
        } else if (bits & 0x8000u) {
          negative |= bit;
        } else {
          positive |= bit;
        }
      }
    }
#pragma unroll
    for (int offset = 1; offset <= 2; offset <<= 1) {
      positive |= __shfl_xor_sync(kFullMask, positive, offset);
      negative |= __shfl_xor_sync(kFullMask, negative, offset);
      zero |= __shfl_xor_sync(kFullMask, zero, offset);
    }
    // Each column's left-out sum as a 2-bit code (0 none, 1 +inf, 2 -inf, 3 NaN), in a loop that is
    // not unrolled (a rare path: its mask loads stay out of the main loops' registers), then
    // added to the accumulators.
    constexpr int kCols = D / 4;  // the lane's columns of the row
    unsigned long long codes[(kCols + 31) / 32] = {};
#pragma unroll 1
    for (int j = 0; j < kCols; ++j) {
      const int d = (j >> 1) * 8 + 2 * q4 + (j & 1);
      const unsigned long long pos = cols.pos[d], neg = cols.neg[d];
      const bool up = ((pos & positive) | (neg & negative)) != 0;
      const bool down = ((neg & positive) | (pos & negative)) != 0;
      const bool nan = ((pos | neg) & zero) != 0 || (up && down);
      const unsigned long long code = nan ? 3 : up ? 1 : down ? 2 : 0;
#pragma unroll
      for (int w = 0; w < (kCols + 31) / 32; ++w) {
        if ((j >> 5) == w) codes[w] |= code << (2 * (j & 31));
      }
    }
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const unsigned code = static_cast<unsigned>(codes[j >> 5] >> (2 * (j & 31))) & 3u;
      if (code == 0) continue;
      const float term = code == 3 ? dm::nan() : code == 1 ? dm::pos_inf() : dm::neg_inf();
      float& a = acc[j >> 1][2 * rr + (j & 1)];
      a = dm::add(a, term);
    }
  }
}

}  // namespace
}  // namespace attn
}  // namespace jaxdet
