// Split mode with the whole split in flight: DecodeSplitKernel, for grids of at most one CTA per
// SM (a decode step of a few sequences). Included by attention_mma.cuh after FwdKernel.
//
// FwdKernel's split mode runs a split's 8 blocks in one warp, one block after the other: at batch 1
// each CTA waits for every copy. Here a CTA of 8 warps takes the same split (the same SplitOut; a
// CTA whose accumulators saw an inf or NaN reruns FwdKernel's careful one-warp CTA itself): warp
// w copies and scores block w, and the steps of the single-warp loop that chain across blocks are
// recomputed from per-block values in shared memory in the loop's order, so every row gets that
// loop's bits:
// * the running maximum before block j is the chain max_nan(... max_nan(-inf, bm_0) ..., bm_j-1)
//   of the block maxima (exact values, the same on a row's 4 lanes), so block j's factor and
//   probabilities are those of the loop (block_probs);
// * l is the loop's chain l = l * alpha_j + ts_j over the blocks in order;
// * P.V: warp w owns output columns [w D/8, (w + 1) D/8) of the 16 rows (whole 8-column MMA
//   tiles, whose chains do not mix columns) and runs, block after block, the loop's rescale and
//   the k16 chain over the block's keys with A = block j's probabilities, packed by the warp that
//   computed them exactly as groups_times_rows packs them.
// The copies: warp w's K tile and its column slices of V for blocks 0 .. kEarly - 1 at once (all
// that shared memory holds besides the K tiles), the later slices into the K tile's place as soon
// as its scores are in.
// A decode step has a few tiles of up to kMaxClusterSplits splits each: their CTAs run as a cluster
// and merge the splits after a cluster barrier, so that no CombineKernel launch follows.
#pragma once

namespace jaxdet {
namespace attn {
namespace {

// A V slice's rows are kCols = 16 elements (two 16-byte chunks) with no padding; chunk c of row r
// sits at chunk c ^ ((r / 4) % 2), so that ldmatrix's eight rows of one chunk fall in distinct banks.
template <class T>
__device__ __forceinline__ T* slice_chunk(T* slice, int row, int chunk) {
  return slice + row * 16 + ((chunk ^ ((row >> 2) & 1)) * 8);
}

// Rows 0 .. kBlock - 1 of the 16 columns at first_row (each row row_stride elements after the
// previous one) into a swizzled slice (slice_chunk), one warp; rows from `valid_rows` on are
// zero-filled.
template <class Elem>
__device__ __forceinline__ void load_column_slice(Elem* slice, const Elem* first_row, int64_t row_stride,
                                                  int valid_rows, const Elem* any, int lane) {
  constexpr int kStep = 16;  // two lanes per row
  const int i0 = lane / 2, chunk = lane % 2;
#pragma unroll
  for (int n = 0; n < kBlock / kStep; ++n) {
    const int row = i0 + n * kStep;
    const bool valid = row < valid_rows;
    cp_async16(slice_chunk(slice, row, chunk), valid ? first_row + row * row_stride + chunk * 8 : any, valid);
  }
}

template <class Elem, int D>
struct DecodeGeom {
  static constexpr int kWarps = kBlocksPerSplit;  // a warp per block of a split
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kCols = D / kWarps;  // the output columns of a warp's P.V
  static_assert(kCols == 16, "a warp's columns are one ldmatrix.x4.trans wide (head dimension 128)");
  static constexpr size_t kKTile = size_t{kBlock} * (D + kPad) * sizeof(Elem);
  static constexpr size_t kSlice = size_t{kBlock} * kCols * sizeof(Elem);  // swizzled (slice_chunk)
  static constexpr size_t kProbs = size_t{16} * 32 * sizeof(uint32_t);      // a block's A fragments
  static constexpr size_t kQ = size_t{16} * (D + kPad) * sizeof(Elem);
  static constexpr size_t kStats = size_t{3} * kWarps * 16 * sizeof(float);  // bm, alpha, ts per block
  static constexpr size_t kRowInfo = size_t{2} * 16 * sizeof(int);
  // A warp's region: its K tile, then the V slices copied with it, as many as an H100's opt-in
  // shared memory per block (227 KiB) holds. The K tile's place, free once the warp's scores are
  // in, takes the later slices and then the block's probabilities.
  static constexpr size_t kPerWarp = (size_t{227} * 1024 - kQ - kStats - kRowInfo) / kWarps;
  static constexpr int kEarly = static_cast<int>(std::min<size_t>((kPerWarp - kKTile) / kSlice, kBlocksPerSplit));
  static constexpr size_t kLate = (kBlocksPerSplit - kEarly) * kSlice;
  static_assert(kEarly >= 1 && kLate + kProbs <= kKTile,
                "the later slices and probabilities fit in the K tile's place");
  static constexpr size_t kProbsAt = kLate;
  static constexpr size_t kRegion = kKTile + kEarly * kSlice;
  static_assert(kKTile % 16 == 0 && kSlice % 16 == 0 && kRegion % 16 == 0, "16-byte copies");
  static constexpr size_t kBytes = kWarps * kRegion + kQ + kStats + kRowInfo;
};

// A CTA whose accumulators saw an inf or NaN recomputes its rows as FwdKernel's careful instance
// would (attention_nonfinite.cuh): FwdKernel's one-warp CTA of the same split and rows, run by
// warp 0 in this CTA's shared memory once every warp is done with it, writes the split's state in
// place of the fast path's. So no careful launch follows. (Out of line: a rare path that keeps its
// registers out of the main loop's allocation.)
template <class Elem, int D>
__device__ __noinline__ void recompute_split_carefully(Problem p, SplitOut ws, unsigned char* smem, int64_t cta_x,
                                                       int64_t h, int64_t b) {
  static_assert(FwdGeom<MmaSyncCore<Elem, D, 1>, 1>::bytes(false) <= DecodeGeom<Elem, D>::kBytes,
                "the careful CTA fits in the decode CTA's shared memory");
  fwd_cta<MmaSyncCore<Elem, D, 1>, 1, true>(p, nullptr, nullptr, ws, nullptr, smem, cta_x, h, b);
}

// Split (ml, part) of one output column merged into the running total (m_tot, l_tot, acc): step 3
// of the canonical order with CombineKernel's functions, whose walk over a row's splits in
// ascending order makes the same calls on the same values.
__device__ __forceinline__ void merge_split(float& m_tot, float& l_tot, float& acc, float2 ml, float part) {
  if (split_is_empty(ml.x)) return;
  const Rescale rs = rescale<FastMath>(m_tot, ml.x);
  l_tot = merge_term(l_tot, rs.old_scale, ml.y, rs.in_scale);
  acc = merge_term(acc, rs.old_scale, part, rs.in_scale);
  m_tot = rs.m_new;
}

// The largest cluster DecodeSplitKernel merges in: the portable cluster size.
constexpr int kMaxClusterSplits = 8;

// The cluster's splits of its 16 rows merged as CombineKernel merges them, once every CTA of the
// cluster (a split each, rank = split) has written its split's state to the workspace: the cluster
// barrier orders every thread's stores before it (release) and the reads after it (acquire). The
// CTA of split z merges every nsplit-th (row, column) of the tile from z on. (The same merge
// through distributed shared memory instead of the workspace was no faster.)
template <class Elem, int D>
__device__ __forceinline__ void merge_splits_in_cluster(const Problem& p, const SplitOut& ws, const int* limits,
                                                        void* o, float* lse2, int64_t tile, int64_t h, int64_t b,
                                                        int z) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Storage = typename MmaElem<Elem>::Storage;
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
  const int nsplit = static_cast<int>(ws.nsplit);
  for (int i = z + nsplit * static_cast<int>(threadIdx.x); i < 16 * D;
       i += nsplit * static_cast<int>(blockDim.x)) {
    const int row = i / D, e = i % D;
    const int64_t r = tile * 16 + row;
    if (r >= p.R) break;  // the rows grow with i
    const int splits = (limits[row] + kSplit - 1) / kSplit;
    const int64_t first = (b * p.H + h) * ws.nsplit * p.R + r;  // split j at first + j * R
    float2 ml[kMaxClusterSplits];
    float part[kMaxClusterSplits];
    const float2* ml_src = ws.ml + first;
    const float* part_src = ws.acc + first * D + e;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j < splits) {
        ml[j] = __ldcg(ml_src);
        part[j] = __ldcg(part_src);
      }
      ml_src += p.R;
      part_src += p.R * D;
    }
    float m_tot = dm::neg_inf(), l_tot = 0.0f, acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kMaxClusterSplits; ++j) {
      if (j < splits) merge_split(m_tot, l_tot, acc, ml[j], part[j]);
    }
    store_elem<Storage>(o, q_index(p, b, h, r) + e, finish_out(acc, out_scale(l_tot)));
    if (e == 0) lse2[stat_index(p, b, h, r)] = finish_lse2<FastMath>(m_tot, l_tot);
  }
#else
  __trap();  // the host launches the merging instance on sm_90 code only (decode_cluster_merges)
#endif
}

// Grid: x = tile * nsplit + split, y = KV head, z = batch element. kClusterMerge: launched in
// clusters of the nsplit CTAs of a tile, which merge the splits themselves; otherwise
// CombineKernel follows.
template <class Elem, int D, bool kClusterMerge>
__global__ void __launch_bounds__(DecodeGeom<Elem, D>::kThreads, 1)
    DecodeSplitKernel(Problem p, SplitOut ws, void* o, float* lse2) {
  using Geo = DecodeGeom<Elem, D>;
  constexpr int kWarps = Geo::kWarps, kThreads = Geo::kThreads, kCols = Geo::kCols, kEarly = Geo::kEarly;
  extern __shared__ __align__(1024) unsigned char smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, q4 = lane & 3;
  unsigned char* region = smem + warp * Geo::kRegion;
  Elem* Kw = reinterpret_cast<Elem*>(region);
  auto slice = [&](int j) {
    return reinterpret_cast<Elem*>(j < kEarly ? region + Geo::kKTile + j * Geo::kSlice
                                              : region + (j - kEarly) * Geo::kSlice);
  };
  unsigned char* shared = smem + kWarps * Geo::kRegion;
  Elem* Qs = reinterpret_cast<Elem*>(shared);
  // Block j's probabilities, [kk * 4 + reg][lane], in warp j's K tile's place once its scores are in.
  auto probs_of = [&](int j) { return reinterpret_cast<uint32_t*>(smem + j * Geo::kRegion + Geo::kProbsAt); };
  float* block_max = reinterpret_cast<float*>(shared + Geo::kQ);  // [block][row]
  float* block_alpha = block_max + kWarps * 16;
  float* block_sum = block_alpha + kWarps * 16;
  PassRows rows{reinterpret_cast<int*>(block_sum + kWarps * 16), nullptr};
  rows.limit = rows.start + 16;

  const int64_t tiles = (p.R + 15) / 16;
  const int64_t tile = blockIdx.x / ws.nsplit;
  const int z = static_cast<int>(blockIdx.x % ws.nsplit);
  const int64_t h = blockIdx.y, b = blockIdx.z, r0 = tile * 16;
  const Elem* k = static_cast<const Elem*>(p.k);
  const Elem* v = static_cast<const Elem*>(p.v);
  const int64_t kv_stride = p.H * p.D;

  load_query_tile<Elem, D, kThreads, 16>(Qs, static_cast<const Elem*>(p.q), p, b, h, r0);
  cp_async_commit();
  // The K tile of a pass whose keys start at memory row 0 (every pass of the positions forms),
  // copied before the rows' descriptions arrive: its rows past the pass's limit (up to the
  // cache's capacity, zero-filled beyond) only reach scores that block_scores_max replaces by
  // -inf, so the tile gives the bits of one copied after them.
  const int first_pos0 = (z * kBlocksPerSplit + warp) * kBlock;
  bool k_in_flight = first_pos0 < p.S;  // the early tile, until a pass takes or drops it
  if (k_in_flight) {
    const Elem* k_first = k + kv_index(p, b, h, 0);
    load_rows_tile<Elem, D, 32>(Kw, k_first + int64_t{first_pos0} * kv_stride, kv_stride,
                                static_cast<int>(p.S - first_pos0), k_first, lane);
  }
  cp_async_commit();
  load_row_info<16, kThreads>(p, b, r0, rows);
  __syncthreads();  // the row descriptions

  const int row_local[2] = {grp, grp + 8};
  bool fired = false;  // an accumulator element this thread probes is inf or NaN
  int cur = -1, plimit = 0;
  while ((cur = next_pass<16>(rows, cur, &plimit)) != INT_MAX) {
    const int blk_begin = z * kBlocksPerSplit;
    const int nb = min((plimit + kBlock - 1) / kBlock - blk_begin, kBlocksPerSplit);
    if (nb <= 0) continue;
    int lim[2];
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) lim[rr] = rows.start[row_local[rr]] == cur ? rows.limit[row_local[rr]] : 0;
    const int64_t pass_offset = kv_index(p, b, h, cur);
    const Elem* k_pass = k + pass_offset;
    const Elem* v_pass = v + pass_offset;
    auto load_slice = [&](int j) {
      const int blk = blk_begin + j;
      load_column_slice<Elem>(slice(j), v_pass + int64_t{blk} * (kBlock * kv_stride) + warp * kCols, kv_stride,
                              plimit - blk * kBlock, v_pass, lane);
    };
    const bool has_block = warp < nb;
    const int pos0 = (blk_begin + warp) * kBlock;
    const bool k_early = k_in_flight && cur == 0;
    if (k_in_flight && !k_early) cp_async_wait<0>();  // the early tile lands before its place is reused
    k_in_flight = false;
    if (has_block && !k_early)
      load_rows_tile<Elem, D, 32>(Kw, k_pass + int64_t{pos0} * kv_stride, kv_stride, plimit - pos0, k_pass, lane);
    cp_async_commit();
    for (int j = 0; j < kEarly && j < nb; ++j) load_slice(j);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();  // the Q tile; each warp's own K tile

    float s[1][8][4], bm[2] = {dm::neg_inf(), dm::neg_inf()};
    if (has_block) {
      groups_dot_tile<Elem, D, 1>(Qs, Kw, s, lane);
      if (__all_sync(kFullMask, pos0 + kBlock <= min(lim[0], lim[1]))) {
        block_scores_max<false>(pos0, lim, p.c, s[0], bm, q4);
      } else {
        block_scores_max<true>(pos0, lim, p.c, s[0], bm, q4);
      }
      bm[0] = row_max_of_lanes(bm[0]);
      bm[1] = row_max_of_lanes(bm[1]);
      if (q4 == 0) {
        block_max[warp * 16 + grp] = bm[0];
        block_max[warp * 16 + grp + 8] = bm[1];
      }
    }
    __syncwarp();  // every lane is done with the K tile
    for (int j = kEarly; j < nb; ++j) load_slice(j);
    cp_async_commit();
    __syncthreads();  // every block's maximum

    // The loop's running maximum: before this warp's block (m_old), after the split's last (m_run).
    float m_run[2] = {dm::neg_inf(), dm::neg_inf()}, m_old[2] = {dm::neg_inf(), dm::neg_inf()};
    for (int j = 0; j < nb; ++j) {
      if (j == warp) m_old[0] = m_run[0], m_old[1] = m_run[1];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) m_run[rr] = max_nan(m_run[rr], block_max[j * 16 + row_local[rr]]);
    }
    if (has_block) {
      float mn[2], alpha[2], ts[2];
      block_probs<false>(m_old, bm, s[0], mn, alpha, ts);
      uint32_t* a = probs_of(warp) + lane;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // groups_times_rows' A fragments
        a[(kk * 4 + 0) * 32] = MmaElem<Elem>::pack(s[0][2 * kk][0], s[0][2 * kk][1]);
        a[(kk * 4 + 1) * 32] = MmaElem<Elem>::pack(s[0][2 * kk][2], s[0][2 * kk][3]);
        a[(kk * 4 + 2) * 32] = MmaElem<Elem>::pack(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
        a[(kk * 4 + 3) * 32] = MmaElem<Elem>::pack(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
      }
      if (q4 == 0) {
        block_alpha[warp * 16 + grp] = alpha[0];
        block_alpha[warp * 16 + grp + 8] = alpha[1];
        block_sum[warp * 16 + grp] = ts[0];
        block_sum[warp * 16 + grp + 8] = ts[1];
      }
    }
    __syncthreads();  // every block's probabilities, factors and sums

    float acc[2][4] = {};
    const int mi = lane >> 3, mr = lane & 7;
    for (int j = 0; j < nb; ++j) {
      if (j == 0) {
        cp_async_wait<1>();
        __syncwarp();
      } else if (j == kEarly) {
        cp_async_wait<0>();
        __syncwarp();
      }
      const float a0 = block_alpha[j * 16 + grp], a1 = block_alpha[j * 16 + grp + 8];
      if (__any_sync(kFullMask, a0 != 1.0f || a1 != 1.0f)) {  // rescale_acc
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          acc[nt][0] = dm::mul(acc[nt][0], a0);
          acc[nt][1] = dm::mul(acc[nt][1], a0);
          acc[nt][2] = dm::mul(acc[nt][2], a1);
          acc[nt][3] = dm::mul(acc[nt][3], a1);
        }
      }
      const Elem* vj = slice(j);
      const uint32_t* pj = probs_of(j) + lane;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint32_t a[4] = {pj[(kk * 4) * 32], pj[(kk * 4 + 1) * 32], pj[(kk * 4 + 2) * 32],
                               pj[(kk * 4 + 3) * 32]};
        uint32_t bf[4];
        ldsm_x4_trans(bf, slice_chunk(vj, kk * 16 + (mi & 1) * 8 + mr, mi >> 1));
        MmaElem<Elem>::mma(acc[0], a, bf[0], bf[1]);
        MmaElem<Elem>::mma(acc[1], a, bf[2], bf[3]);
      }
    }
    fired = fired || probe_nonfinite<16>(acc, p.zero);

#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int64_t r = r0 + row_local[rr];
      if (r >= p.R || rows.start[row_local[rr]] != cur) continue;
      const int64_t base = ((b * p.H + h) * ws.nsplit + z) * p.R + r;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        *reinterpret_cast<float2*>(ws.acc + base * D + warp * kCols + nt * 8 + 2 * q4) =
            make_float2(acc[nt][2 * rr], acc[nt][2 * rr + 1]);
      }
      if (warp == 0 && q4 == 0) {
        float l = 0.0f;  // the loop's chain
        for (int j = 0; j < nb; ++j)
          l = dm::add(dm::mul(l, block_alpha[j * 16 + row_local[rr]]), block_sum[j * 16 + row_local[rr]]);
        ws.ml[base] = make_float2(m_run[rr], l);
      }
    }
    __syncthreads();  // the next pass's copies overwrite this warp's slices and probabilities, which all read
  }
  cp_async_wait<0>();  // an early tile no pass took
  if (__syncthreads_or(fired) && warp == 0) {
    recompute_split_carefully<Elem, D>(p, ws, smem, tile + int64_t{z} * tiles, h, b);  // FwdKernel's grid
  }
  if constexpr (kClusterMerge) merge_splits_in_cluster<Elem, D>(p, ws, rows.limit, o, lse2, tile, h, b, z);
}

}  // namespace
}  // namespace attn
}  // namespace jaxdet
