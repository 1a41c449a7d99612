// The Hopper forward in final mode with warp specialization (as in FlashAttention-3): a CTA of
// four warpgroups, three that compute 64 query rows each (the consumers) and one that only copies
// the K/V blocks into shared memory (the producer). Included by attention_mma.cuh.
//
// The bits are FwdKernel's with WgmmaCore: each consumer warpgroup runs FwdKernel's overlapped loop
// on the same blocks in the same order (the same wgmma chains, fwd_softmax, rescale_acc and
// RunningTotal); only who copies the tiles and how the warps wait for them differ. The producer's
// cp.async copies land in a ring of two K and two V tiles; it signals a tile's mbarrier when its
// copies have landed, and the consumers release a tile once their wgmma has read it, so no
// consumer waits at a CTA-wide barrier inside the loop, and one copy of each tile feeds 192 rows.
//
// Non-finite inputs: each consumer warpgroup flags its 64 rows as FwdKernel flags a CTA; the
// careful launch (FwdKernel<WgmmaCore, 4, true>, 64-row CTAs) recomputes the flagged ones.
#pragma once

namespace jaxdet {
namespace attn {
namespace {

template <class Elem, int D>
struct FwdWsGeom {
  using Core = WgmmaCore<Elem, D>;
  // Warpgroups of 64 rows: three keep four warps on each scheduler (two ran no faster than
  // FwdKernel's one-warpgroup CTAs, two per SM), and their running totals fill the shared memory.
  static constexpr int kConsumers = 3;
  static constexpr int kRows = 64 * kConsumers, kConsumerThreads = 128 * kConsumers, kProducerThreads = 128;
  static constexpr int kThreads = kConsumerThreads + kProducerThreads;
  static constexpr int kStages = 2;  // K and V tiles each
  // setmaxnreg: the producer gives registers to the consumers (a multiple of 8 each, 128 x
  // (producer + kConsumers x consumer) <= 65536).
  static constexpr int kProducerRegisters = 32;
  static constexpr int kConsumerRegisters = (65536 / 128 - kProducerRegisters) / kConsumers / 8 * 8;
  static constexpr size_t kKV = Core::kTile;
  static constexpr size_t kK = 0, kV = kK + kStages * kKV, kQ = kV + kStages * kKV;
  static constexpr size_t kRowInfo = kQ + Core::query_tile_bytes(kRows);
  static constexpr size_t kStash = kRowInfo + size_t{2} * kRows * sizeof(int);
  static constexpr size_t kBarriers = kStash + (kConsumerThreads / 32) * RunningTotal<1, D>::warp_bytes();
  // full K, full V, empty K, empty V (kStages each), then a flag per consumer warpgroup
  static constexpr size_t kFlags = kBarriers + 4 * kStages * sizeof(uint64_t);
  static constexpr size_t kBytes = kFlags + kConsumers * sizeof(int);
  static_assert(kV % Core::kTileAlign == 0 && kQ % Core::kTileAlign == 0, "tiles keep their alignment");
};

template <class Elem, int D>
__global__ void __launch_bounds__(FwdWsGeom<Elem, D>::kThreads, 1)
    FwdWsKernel(Problem p, void* o, float* lse2, int* fired_tiles) {
  using Geo = FwdWsGeom<Elem, D>;
  using Core = typename Geo::Core;
  using Storage = typename MmaElem<Elem>::Storage;
  constexpr int kRows = Geo::kRows, kStages = Geo::kStages;
  constexpr size_t kTileElems = Geo::kKV / sizeof(Elem);
  extern __shared__ __align__(1024) unsigned char smem[];
  Elem* Ks = reinterpret_cast<Elem*>(smem + Geo::kK);
  Elem* Vs = reinterpret_cast<Elem*>(smem + Geo::kV);
  Elem* Qs = reinterpret_cast<Elem*>(smem + Geo::kQ);
  PassRows rows{reinterpret_cast<int*>(smem + Geo::kRowInfo), nullptr};
  rows.limit = rows.start + kRows;
  float* stash = reinterpret_cast<float*>(smem + Geo::kStash);
  uint64_t* full_k = reinterpret_cast<uint64_t*>(smem + Geo::kBarriers);
  uint64_t* full_v = full_k + kStages;
  uint64_t* empty_k = full_v + kStages;
  uint64_t* empty_v = empty_k + kStages;
  int* wg_fired = reinterpret_cast<int*>(smem + Geo::kFlags);

  // The heaviest tiles first, across every (batch, head): under a causal mask a tile's work grows
  // with its index, and the GPU starts CTAs in launch order, so the short tiles fill the last
  // wave (which CTA computes a tile changes no bit).
  const int64_t tiles = gridDim.x, heads = gridDim.y;
  const int64_t launch = cta_index(), bh = heads * gridDim.z;
  const int64_t tile = tiles - 1 - launch / bh, h = launch % bh % heads, b = launch % bh / heads;
  const int64_t r0 = tile * kRows;
  const bool producer = threadIdx.x >= Geo::kConsumerThreads;

  load_row_info<kRows, Geo::kThreads>(p, b, r0, rows);
  if (!producer) {
    load_query_tile<Elem, D, Geo::kConsumerThreads, kRows, typename Core::QueryChunks>(
        Qs, static_cast<const Elem*>(p.q), p, b, h, r0);
  }
  cp_async_commit();
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      mbarrier_init(full_k + i, Geo::kProducerThreads);  // every producer thread's copies
      mbarrier_init(full_v + i, Geo::kProducerThreads);
      mbarrier_init(empty_k + i, Geo::kConsumerThreads);  // every consumer thread's wgmma
      mbarrier_init(empty_v + i, Geo::kConsumerThreads);
    }
    for (int i = 0; i < Geo::kConsumers; ++i) wg_fired[i] = 0;
  }
  cp_async_wait<0>();
  fence_copies_for_wgmma();
  __syncthreads();

  const int64_t kv_stride = p.H * p.D;  // elements between consecutive key positions
  bool fired = false;  // an accumulator element this thread probes is inf or NaN
  if (producer) {
    warpgroup_registers_down<Geo::kProducerRegisters>();
    const int tid = static_cast<int>(threadIdx.x) - Geo::kConsumerThreads;
    const Elem* k = static_cast<const Elem*>(p.k);
    const Elem* v = static_cast<const Elem*>(p.v);
    int n = 0;  // blocks copied, over every pass: the consumers count the same sequence
    int cur = -1, plimit = 0;
    while ((cur = next_pass<kRows>(rows, cur, &plimit)) != INT_MAX) {
      const int nblocks = (plimit + kBlock - 1) / kBlock;
      const int64_t pass_offset = kv_index(p, b, h, cur);
      for (int blk = 0; blk < nblocks; ++blk, ++n) {
        const int stage = n % kStages;
        const uint32_t parity = (n / kStages) & 1;
        const int64_t offset = pass_offset + int64_t{blk} * (kBlock * kv_stride);
        const int valid = plimit - blk * kBlock;
        mbarrier_wait(empty_k + stage, parity ^ 1);
        Core::template load_tile<Geo::kProducerThreads>(Ks + stage * kTileElems, k + offset, kv_stride, valid, k,
                                                        tid);
        mbarrier_arrive_on_copies(full_k + stage);
        mbarrier_wait(empty_v + stage, parity ^ 1);
        Core::template load_tile<Geo::kProducerThreads>(Vs + stage * kTileElems, v + offset, kv_stride, valid, v,
                                                        tid);
        mbarrier_arrive_on_copies(full_v + stage);
      }
    }
    cp_async_wait<0>();
  } else {
    warpgroup_registers_up<Geo::kConsumerRegisters>();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = lane >> 2, q4 = lane & 3;
    const int wg = warp / 4;
    RunningTotal<1, D> total(stash, warp, lane);
    total.clear();
    const int row_local[1][2] = {{warp * 16 + grp, warp * 16 + grp + 8}};
    Core core(Qs, warp, lane, p);
    float m[1][2], l[1][2], acc[1][D / 8][4];
    // A tile's copies have landed (and, through the proxy fence, are visible to wgmma), or this
    // thread's wgmma is done with it.
    auto wait_full = [&](uint64_t* full, int n) {
      mbarrier_wait(full + n % kStages, (n / kStages) & 1);
      fence_copies_for_wgmma();
    };
    auto release = [&](uint64_t* empty, int n) { mbarrier_arrive(empty + n % kStages); };
    auto k_tile = [&](int n) { return Ks + (n % kStages) * kTileElems; };
    auto v_tile = [&](int n) { return Vs + (n % kStages) * kTileElems; };
    int n = 0;
    int cur = -1, plimit = 0;
    while ((cur = next_pass<kRows>(rows, cur, &plimit)) != INT_MAX) {
      int lim[1][2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        lim[0][rr] = rows.start[row_local[0][rr]] == cur ? rows.limit[row_local[0][rr]] : 0;
      }
      const int nblocks = (plimit + kBlock - 1) / kBlock;
      auto softmax = [&](int blk, float (&s)[1][8][4], float (&alpha)[1][2]) {
        const int pos0 = blk * kBlock;
        if (__all_sync(kFullMask, pos0 + kBlock <= min(lim[0][0], lim[0][1]))) {
          fwd_softmax<1, false>(pos0, lim, p.c, m, l, s, alpha, lane);
        } else {
          fwd_softmax<1, true>(pos0, lim, p.c, m, l, s, alpha, lane);
        }
      };
      // FwdKernel's overlapped loop: block blk's scores and softmax under block blk - 1's P.V.
      typename Core::Probs pend;
      float s[1][8][4], alpha[1][2];
      for (int s0 = 0; s0 < nblocks; s0 += kBlocksPerSplit) {
        const int s1 = min(s0 + kBlocksPerSplit, nblocks);
        start_split<1, D>(m, l, acc);
        wait_full(full_k, n);
        core.scores(k_tile(n), s);
        release(empty_k, n);
        softmax(s0, s, alpha);
        rescale_acc<D, 1>(alpha, acc);
        Core::pack_probs(s, pend);
        int prev = n++;
        for (int blk = s0 + 1; blk < s1; ++blk, ++n) {
          wait_full(full_k, n);
          wait_full(full_v, prev);
          core.scores_issue(k_tile(n), s);
          core.pv_issue(pend, v_tile(prev), acc);
          Core::template wait_scores<1>(s);
          release(empty_k, n);
          softmax(blk, s, alpha);
          Core::wait_pv(acc);
          release(empty_v, prev);
          rescale_acc<D, 1>(alpha, acc);
          Core::pack_probs(s, pend);
          prev = n;
        }
        wait_full(full_v, prev);
        core.pv_issue(pend, v_tile(prev), acc);
        Core::wait_pv(acc);
        release(empty_v, prev);
        fired = fired || probe_nonfinite<D>(acc[0], p.zero);
        total.merge(m, l, acc);
      }
    }
    // A tile held an inf or NaN (or a row's own terms made one): the careful launch recomputes
    // this warpgroup's 64 rows (attention_nonfinite.cuh).
    if (__any_sync(kFullMask, fired) && lane == 0) wg_fired[wg] = 1;
    warpgroup_sync(wg);
    const bool wg_any = wg_fired[wg] != 0;
    const int64_t tiles64 = (p.R + 63) / 64, tile64 = tile * Geo::kConsumers + wg;
    if (threadIdx.x % 128 == 0 && tile64 < tiles64) {
      fired_tiles[tile64 + tiles64 * (h + heads * b)] = wg_any ? 1 : 0;
    }
    if (!wg_any) total.template store<Storage>(p, o, lse2, b, h, r0, row_local, q4);
  }
}

}  // namespace
}  // namespace attn
}  // namespace jaxdet
