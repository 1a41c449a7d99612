// The float32 kernels of jaxdet.attention: one warp per row, the CPU order of attention_cpu.cc
// operation for operation (included by attention_cuda.cu only).
//
// Forward, per query row: lane j of the warp computes key j's score of a block (a sequential dot
// product over the head dimension), the block max is a butterfly (exact), every lane sums the
// block's probabilities in ascending key order, and lane e owns output columns e, e + 32, ...,
// adding p_j * v_j in ascending key order. Backward: dQ the same way per query row; dK/dV one warp
// per key row, adding the rows' contributions in ascending row order.
#pragma once

namespace jaxdet {
namespace attn {
namespace {

constexpr int kSimtWarps = 4;
constexpr int kSimtCols = 8;  // output columns per lane: D <= 256

// ((0 + a_0*b_0) + a_1*b_1) + ... with a in shared memory (float32) and b in global memory.
template <typename Storage>
__device__ __forceinline__ float dot_seq(const float* a, const void* b, int64_t off, int D) {
  float x = 0.0f;
  for (int e = 0; e < D; ++e) x = dm::add(x, dm::mul(a[e], load_elem<Storage>(b, off + e)));
  return x;
}

template <typename Storage>
__global__ void __launch_bounds__(kSimtWarps * 32) FwdSimtKernel(Problem p, void* o, float* lse2) {
  __shared__ float qs[kSimtWarps][256];
  __shared__ float ps[kSimtWarps][kBlock];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = int64_t{blockIdx.x} * kSimtWarps + warp;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  if (r >= p.R) return;  // no block-wide barrier below
  const int D = static_cast<int>(p.D);
  const RowKeys keys = row_keys(p.rows, p.T, p.S, b, r / p.G);
  const int64_t qoff = q_index(p, b, h, r);
  for (int e = lane; e < D; e += 32) qs[warp][e] = load_elem<Storage>(p.q, qoff + e);
  __syncwarp();
  float acc[kSimtCols], total[kSimtCols];
#pragma unroll
  for (int i = 0; i < kSimtCols; ++i) acc[i] = total[i] = 0.0f;
  float m_total = dm::neg_inf(), l_total = 0.0f;
  for (int64_t split = 0; split * kSplit < keys.limit; ++split) {
    float m = dm::neg_inf(), l = 0.0f;
#pragma unroll
    for (int i = 0; i < kSimtCols; ++i) acc[i] = 0.0f;
    const int64_t split_end = min(static_cast<int64_t>((split + 1) * kSplit), keys.limit);
    for (int64_t pos = split * kSplit; pos < split_end; pos += kBlock) {
      const int n = static_cast<int>(min(static_cast<int64_t>(kBlock), split_end - pos));
      const int64_t first = keys.start + pos;
      float x0 = dm::neg_inf(), x1 = dm::neg_inf();
      if (lane < n) x0 = dm::mul(dot_seq<Storage>(qs[warp], p.k, kv_index(p, b, h, first + lane), D), p.c);
      if (lane + 32 < n)
        x1 = dm::mul(dot_seq<Storage>(qs[warp], p.k, kv_index(p, b, h, first + lane + 32), D), p.c);
      float bm = max_nan(max_nan(dm::neg_inf(), x0), x1);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) bm = max_nan(bm, __shfl_xor_sync(kFullMask, bm, off));
      const Rescale rs = rescale<CanonicalMath>(m, bm);
      if (rs.empty) continue;  // the same on every lane
      ps[warp][lane] = lane < n ? exp2_canonical(dm::sub(x0, rs.m_new)) : 0.0f;
      ps[warp][lane + 32] = lane + 32 < n ? exp2_canonical(dm::sub(x1, rs.m_new)) : 0.0f;
      __syncwarp();
      float block_sum = 0.0f;
      for (int j = 0; j < n; ++j) block_sum = dm::add(block_sum, ps[warp][j]);
      l = dm::add(dm::mul(l, rs.old_scale), block_sum);
#pragma unroll
      for (int i = 0; i < kSimtCols; ++i) acc[i] = dm::mul(acc[i], rs.old_scale);
      for (int j = 0; j < n; ++j) {
        const float pj = ps[warp][j];
        const int64_t voff = kv_index(p, b, h, first + j);
#pragma unroll
        for (int i = 0; i < kSimtCols; ++i) {
          const int e = lane + 32 * i;
          if (e < D) acc[i] = dm::add(acc[i], dm::mul(pj, load_elem<Storage>(p.v, voff + e)));
        }
      }
      __syncwarp();
      m = rs.m_new;
    }
    if (split_is_empty(m)) continue;
    const Rescale rs = rescale<CanonicalMath>(m_total, m);
    l_total = merge_term(l_total, rs.old_scale, l, rs.in_scale);
#pragma unroll
    for (int i = 0; i < kSimtCols; ++i) total[i] = merge_term(total[i], rs.old_scale, acc[i], rs.in_scale);
    m_total = rs.m_new;
  }
  const float inv_l = out_scale(l_total);
#pragma unroll
  for (int i = 0; i < kSimtCols; ++i) {
    const int e = lane + 32 * i;
    if (e < D) store_elem<Storage>(o, qoff + e, finish_out(total[i], inv_l));
  }
  if (lane == 0) lse2[stat_index(p, b, h, r)] = finish_lse2<CanonicalMath>(m_total, l_total);
}

// dq = scale * sum_j ds_j k_j over the row's keys in ascending order (the CPU order).
template <typename Storage>
__global__ void __launch_bounds__(kSimtWarps * 32) DqSimtKernel(Problem p, BackwardOut out) {
  __shared__ float qs[kSimtWarps][256];
  __shared__ float dos[kSimtWarps][256];
  __shared__ float dss[kSimtWarps][kBlock];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = int64_t{blockIdx.x} * kSimtWarps + warp;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  if (r >= p.R) return;
  const int D = static_cast<int>(p.D);
  const RowKeys keys = row_keys(p.rows, p.T, p.S, b, r / p.G);
  const int64_t qoff = q_index(p, b, h, r);
  for (int e = lane; e < D; e += 32) {
    qs[warp][e] = load_elem<Storage>(p.q, qoff + e);
    dos[warp][e] = load_elem<Storage>(out.dout, qoff + e);
  }
  __syncwarp();
  const float lse2 = out.lse2[stat_index(p, b, h, r)];
  const float delta = out.delta[stat_index(p, b, h, r)];
  float acc[kSimtCols];
#pragma unroll
  for (int i = 0; i < kSimtCols; ++i) acc[i] = 0.0f;
  for (int64_t pos = 0; pos < keys.limit; pos += kBlock) {
    const int n = static_cast<int>(min(static_cast<int64_t>(kBlock), keys.limit - pos));
    const int64_t first = keys.start + pos;
    for (int j = lane; j < n; j += 32) {
      const int64_t off = kv_index(p, b, h, first + j);
      const float x = dm::mul(dot_seq<Storage>(qs[warp], p.k, off, D), p.c);
      const float dp = dot_seq<Storage>(dos[warp], p.v, off, D);
      const float pj = exp2_canonical(dm::sub(x, lse2));
      dss[warp][j] = dm::mul(pj, dm::sub(dp, delta));
    }
    __syncwarp();
    for (int j = 0; j < n; ++j) {
      const float ds = dss[warp][j];
      const int64_t koff = kv_index(p, b, h, first + j);
#pragma unroll
      for (int i = 0; i < kSimtCols; ++i) {
        const int e = lane + 32 * i;
        if (e < D) acc[i] = dm::add(acc[i], dm::mul(ds, load_elem<Storage>(p.k, koff + e)));
      }
    }
    __syncwarp();
  }
#pragma unroll
  for (int i = 0; i < kSimtCols; ++i) {
    const int e = lane + 32 * i;
    if (e < D) store_elem<Storage>(out.dq, qoff + e, dm::mul(acc[i], out.scale));
  }
}

// dk_j = scale * sum_r ds_rj q_r and dv_j = sum_r p_rj do_r over the rows r that see key j, in
// ascending row order (t, then g): the CPU order. Lanes compute 32 rows' p and ds at a time.
template <typename Storage>
__global__ void __launch_bounds__(kSimtWarps * 32) DkdvSimtKernel(Problem p, BackwardOut out) {
  __shared__ float ks[kSimtWarps][256];
  __shared__ float vs[kSimtWarps][256];
  __shared__ float pp[kSimtWarps][32];
  __shared__ float dd[kSimtWarps][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t s = int64_t{blockIdx.x} * kSimtWarps + warp;
  const int64_t h = blockIdx.y, b = blockIdx.z;
  if (s >= p.S) return;
  const int D = static_cast<int>(p.D);
  const int64_t koff = kv_index(p, b, h, s);
  for (int e = lane; e < D; e += 32) {
    ks[warp][e] = load_elem<Storage>(p.k, koff + e);
    vs[warp][e] = load_elem<Storage>(p.v, koff + e);
  }
  __syncwarp();
  float dk[kSimtCols], dv[kSimtCols];
#pragma unroll
  for (int i = 0; i < kSimtCols; ++i) dk[i] = dv[i] = 0.0f;
  for (int64_t r0 = 0; r0 < p.R; r0 += 32) {
    const int64_t r = r0 + lane;
    bool visible = false;
    if (r < p.R) {
      const RowKeys keys = row_keys(p.rows, p.T, p.S, b, r / p.G);
      visible = keys.start <= s && s < keys.start + keys.limit;
    }
    const unsigned vis = __ballot_sync(kFullMask, visible);
    if (vis == 0) continue;
    if (visible) {
      const int64_t qoff = q_index(p, b, h, r);
      const float x = dm::mul(dot_seq<Storage>(ks[warp], p.q, qoff, D), p.c);
      const float dp = dot_seq<Storage>(vs[warp], out.dout, qoff, D);
      const float pr = exp2_canonical(dm::sub(x, out.lse2[stat_index(p, b, h, r)]));
      pp[warp][lane] = pr;
      dd[warp][lane] = dm::mul(pr, dm::sub(dp, out.delta[stat_index(p, b, h, r)]));
    }
    __syncwarp();
    for (int jj = 0; jj < 32; ++jj) {
      if (!((vis >> jj) & 1u)) continue;
      const int64_t qoff = q_index(p, b, h, r0 + jj);
      const float pr = pp[warp][jj], ds = dd[warp][jj];
#pragma unroll
      for (int i = 0; i < kSimtCols; ++i) {
        const int e = lane + 32 * i;
        if (e < D) {
          dk[i] = dm::add(dk[i], dm::mul(ds, load_elem<Storage>(p.q, qoff + e)));
          dv[i] = dm::add(dv[i], dm::mul(pr, load_elem<Storage>(out.dout, qoff + e)));
        }
      }
    }
    __syncwarp();
  }
#pragma unroll
  for (int i = 0; i < kSimtCols; ++i) {
    const int e = lane + 32 * i;
    if (e < D) {
      store_elem<Storage>(out.dk, koff + e, dm::mul(dk[i], out.scale));
      store_elem<Storage>(out.dv, koff + e, dv[i]);
    }
  }
}

template <typename Storage>
void launch_forward_simt(cudaStream_t stream, const Problem& p, void* o, float* lse2) {
  const dim3 grid(static_cast<unsigned>((p.R + kSimtWarps - 1) / kSimtWarps), static_cast<unsigned>(p.H),
                  static_cast<unsigned>(p.B));
  FwdSimtKernel<Storage><<<grid, kSimtWarps * 32, 0, stream>>>(p, o, lse2);
}

template <typename Storage>
void launch_backward_simt(cudaStream_t stream, const Problem& p, const BackwardOut& out) {
  launch_delta<Storage>(stream, p, out);
  if (p.B * p.H * p.R > 0) {
    const dim3 grid(static_cast<unsigned>((p.R + kSimtWarps - 1) / kSimtWarps), static_cast<unsigned>(p.H),
                    static_cast<unsigned>(p.B));
    DqSimtKernel<Storage><<<grid, kSimtWarps * 32, 0, stream>>>(p, out);
  }
  if (p.B * p.H * p.S > 0) {
    const dim3 grid(static_cast<unsigned>((p.S + kSimtWarps - 1) / kSimtWarps), static_cast<unsigned>(p.H),
                    static_cast<unsigned>(p.B));
    DkdvSimtKernel<Storage><<<grid, kSimtWarps * 32, 0, stream>>>(p, out);
  }
}

}  // namespace
}  // namespace attn
}  // namespace jaxdet
