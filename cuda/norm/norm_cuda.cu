// CUDA targets of RMSNorm / LayerNorm. One 256-thread block per row (grid-stride over rows):
// thread t is lane t of the canonical span order (common/det_math.h), so a row's bits depend on
// that row and the parameters only, never on the number of rows or the launch grid. Rows of up to
// 8192 elements stay in registers between the passes (one read of x, one write of y); longer rows
// re-read x from global memory (L2) for each pass, in the same order.
//
// The parameter gradients are column-parallel: one thread per column walks an aligned run of
// kGradBlock tokens and reduces them by the canonical tree (norm_math.h's block_tree); the runs'
// partials are reduced the same way, 32 at a time, level by level (the upper levels of the tree).
//
// Layouts as in norm_cpu.cc.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "common/cuda_common.h"
#include "common/det_math.h"
#include "common/det_reduce_cuda.cuh"
#include "norm/norm_ffi.h"
#include "norm/norm_math.h"

namespace jaxdet {
namespace {

namespace dm = ::jaxdet::detmath;
using dm::kLanes;
using dm::kStep;
using dm::kVec;

struct RowArgs {
  int64_t rows;            // G * R
  int64_t rows_per_group;  // R
  int64_t n;
  int64_t w_stride;  // group stride of w (0 or n)
  int64_t b_stride;
};

// kSteps > 0: the row (n <= kSteps * kStep) is held in registers. kSteps == 0: streamed. kExact:
// n == kSteps * kStep and every row and parameter vector aligned (the usual model widths), so no
// element is masked and every access is a whole vector.
template <typename S, int kSteps, bool kExact = false>
__global__ void __launch_bounds__(kLanes)
    NormFwdKernel(const typename S::Bits* __restrict__ x, const float* __restrict__ w, const float* __restrict__ b,
                  typename S::Bits* __restrict__ y, float* __restrict__ stats, RowArgs a, float eps, bool center,
                  bool has_bias) {
  using Bits = typename S::Bits;
  constexpr int kHeld = kSteps > 0 ? kSteps : 1;
  static_assert(!kExact || kSteps > 0, "an exact row is held in registers");
  __shared__ float sh[kLanes];
  const int lane = threadIdx.x;
  __builtin_assume(lane < kLanes);
  const int64_t n = kExact ? int64_t{kSteps} * kStep : a.n;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t grp = row / a.rows_per_group;
    const Bits* xr = x + row * n;
    Bits* yr = y + row * n;
    const float* wr = w + grp * a.w_stride;
    const float* br = has_bias ? b + grp * a.b_stride : nullptr;
    const bool xvec = kExact || dm::vec_aligned<Bits>(xr);
    const bool yvec = kExact || dm::vec_aligned<Bits>(yr);
    const bool wvec = kExact || (dm::vec_aligned<float>(wr) && (!has_bias || dm::vec_aligned<float>(br)));
    float v[kHeld][kVec];
    if (kSteps > 0) {
#pragma unroll
      for (int k = 0; k < kHeld; ++k) dm::load_lane<S>(xr, k * kStep + lane * kVec, n, xvec, 0.0f, v[k]);
    }
    // Pass 1 (LayerNorm): the sum of x.
    float mean = 0.0f;
    if (center) {
      float acc = 0.0f;
      if (kSteps > 0) {
#pragma unroll
        for (int k = 0; k < kHeld; ++k) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            if (k * kStep + lane * kVec + j < n) acc = dm::add(acc, v[k][j]);
          }
        }
      } else {
        for (int64_t base = lane * kVec; base < n; base += kStep) {
          float u[kVec];
          dm::load_lane<S>(xr, base, n, xvec, 0.0f, u);
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            if (base + j < n) acc = dm::add(acc, u[j]);
          }
        }
      }
      mean = norm::mean_of(dm::block_tree_sum(acc, sh), n);
    }
    // Pass 2: the sum of (x - mean)^2.
    float acc = 0.0f;
    if (kSteps > 0) {
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          if (k * kStep + lane * kVec + j < n) acc = dm::add(acc, norm::centered_square(v[k][j], mean));
        }
      }
    } else {
      for (int64_t base = lane * kVec; base < n; base += kStep) {
        float u[kVec];
        dm::load_lane<S>(xr, base, n, xvec, 0.0f, u);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {
          if (base + j < n) acc = dm::add(acc, norm::centered_square(u[j], mean));
        }
      }
    }
    const float rstd = norm::rstd_of(dm::block_tree_sum(acc, sh), n, eps);
    if (lane == 0) {
      stats[2 * row] = mean;
      stats[2 * row + 1] = rstd;
    }
    // Pass 3: y.
    auto write = [&](int64_t base, const float (&u)[kVec]) {
      float wv[kVec], bv[kVec] = {0.0f, 0.0f, 0.0f, 0.0f}, out[kVec];
      dm::load_lane<F32Storage>(reinterpret_cast<const uint32_t*>(wr), base, n, wvec, 0.0f, wv);
      if (has_bias) dm::load_lane<F32Storage>(reinterpret_cast<const uint32_t*>(br), base, n, wvec, 0.0f, bv);
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = norm::forward(u[j], mean, rstd, wv[j], bv[j], has_bias);
      dm::store_lane<S>(yr, base, n, yvec, out);
    };
    if (kSteps > 0) {
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {
        const int64_t base = k * kStep + lane * kVec;
        if (base < n) write(base, v[k]);
      }
    } else {
      for (int64_t base = lane * kVec; base < n; base += kStep) {
        float u[kVec];
        dm::load_lane<S>(xr, base, n, xvec, 0.0f, u);
        write(base, u);
      }
    }
  }
}

template <typename S, int kSteps, bool kExact = false>
__global__ void __launch_bounds__(kLanes)
    NormBwdKernel(const typename S::Bits* __restrict__ x, const float* __restrict__ w,
                  const float* __restrict__ stats, const typename S::Bits* __restrict__ g,
                  typename S::Bits* __restrict__ dx, RowArgs a, bool center) {
  using Bits = typename S::Bits;
  constexpr int kHeld = kSteps > 0 ? kSteps : 1;
  static_assert(!kExact || kSteps > 0, "an exact row is held in registers");
  __shared__ float2 sh[kLanes];
  const int lane = threadIdx.x;
  __builtin_assume(lane < kLanes);
  const int64_t n = kExact ? int64_t{kSteps} * kStep : a.n;
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t grp = row / a.rows_per_group;
    const Bits* xr = x + row * n;
    const Bits* gr = g + row * n;
    Bits* dr = dx + row * n;
    const float* wr = w + grp * a.w_stride;
    const bool xvec = kExact || (dm::vec_aligned<Bits>(xr) && dm::vec_aligned<Bits>(gr));
    const bool dvec = kExact || dm::vec_aligned<Bits>(dr);
    const bool wvec = kExact || dm::vec_aligned<float>(wr);
    const float mean = stats[2 * row], rstd = stats[2 * row + 1];
    // xhat and gw of one lane's kVec elements.
    auto lane_terms = [&](int64_t base, float (&xh)[kVec], float (&gw)[kVec]) {
      float wv[kVec];
      dm::load_lane<S>(xr, base, n, xvec, 0.0f, xh);
      dm::load_lane<S>(gr, base, n, xvec, 0.0f, gw);
      dm::load_lane<F32Storage>(reinterpret_cast<const uint32_t*>(wr), base, n, wvec, 0.0f, wv);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        xh[j] = norm::normalized(xh[j], mean, rstd);
        gw[j] = norm::grad_scaled(gw[j], wv[j]);
      }
    };
    float xh[kHeld][kVec], gw[kHeld][kVec];
    float acc_a = 0.0f, acc_b = 0.0f;
    auto fold = [&](int64_t base, const float (&xs)[kVec], const float (&gs)[kVec]) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        if (base + j < n) {
          acc_a = dm::add(acc_a, gs[j]);
          acc_b = dm::add(acc_b, dm::mul(gs[j], xs[j]));
        }
      }
    };
    if (kSteps > 0) {
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {
        const int64_t base = k * kStep + lane * kVec;
        lane_terms(base, xh[k], gw[k]);
        fold(base, xh[k], gw[k]);
      }
    } else {
      for (int64_t base = lane * kVec; base < n; base += kStep) {
        lane_terms(base, xh[0], gw[0]);
        fold(base, xh[0], gw[0]);
      }
    }
    const float2 sums = dm::block_tree_sum2(acc_a, acc_b, sh);
    const float ma = center ? norm::mean_of(sums.x, n) : 0.0f;
    const float mb = norm::mean_of(sums.y, n);
    auto write = [&](int64_t base, const float (&xs)[kVec], const float (&gs)[kVec]) {
      float out[kVec];
#pragma unroll
      for (int j = 0; j < kVec; ++j) out[j] = norm::backward_from(xs[j], gs[j], rstd, ma, mb, center);
      dm::store_lane<S>(dr, base, n, dvec, out);
    };
    if (kSteps > 0) {
#pragma unroll
      for (int k = 0; k < kHeld; ++k) {
        const int64_t base = k * kStep + lane * kVec;
        if (base < n) write(base, xh[k], gw[k]);
      }
    } else {
      for (int64_t base = lane * kVec; base < n; base += kStep) {
        lane_terms(base, xh[0], gw[0]);
        write(base, xh[0], gw[0]);
      }
    }
  }
}

// Adds leaf i (0-based, a constant once unrolled) of an aligned run of 32 to the pending complete
// subtrees of 1, 2, 4, ..., 32 leaves: it merges, as the right child, with the pending subtree of
// every level where i has a 1 bit below its lowest 0 bit (the walk of detmath::tree_fold).
template <int kWidth>
__device__ __forceinline__ void insert_leaf(int i, float (&v)[kWidth], float (&pending)[6][kWidth]) {
#pragma unroll
  for (int level = 0; level < 6; ++level) {
    if (level == 5 || ((i >> level) & 1) == 0) {
#pragma unroll
      for (int j = 0; j < kWidth; ++j) pending[level][j] = v[j];
      return;
    }
#pragma unroll
    for (int j = 0; j < kWidth; ++j) v[j] = dm::add(pending[level][j], v[j]);
  }
}

// The root of the padded tree over the m (1 ... 32) leaves inserted: the pending subtrees (one per
// 1 bit of m) folded from the smallest, each as the left child of the fold so far.
template <int kWidth>
__device__ __forceinline__ void fold_pending(int m, const float (&pending)[6][kWidth], float (&out)[kWidth]) {
  bool have = false;
#pragma unroll
  for (int level = 0; level < 6; ++level) {
    if ((m >> level) & 1) {
#pragma unroll
      for (int j = 0; j < kWidth; ++j) out[j] = have ? dm::add(pending[level][j], out[j]) : pending[level][j];
      have = true;
    }
  }
}

// The parameter-gradient partials: per (group, aligned block of kGradBlock tokens, column), the
// canonical tree over the block's tokens of g * xhat (and of g): norm::block_tree's tree, evaluated
// as the tokens arrive (insert_leaf), so a thread holds six partials per column rather than 32
// terms and takes kVec consecutive columns with vector loads. grid.x: column tiles of kLanes * kVec
// columns; grid.y: (group, token block) pairs, grid-stride.
template <typename S>
__global__ void __launch_bounds__(kLanes)
    NormParamGradKernel(const typename S::Bits* __restrict__ x, const float* __restrict__ stats,
                        const typename S::Bits* __restrict__ g, float* __restrict__ pw, float* __restrict__ pb,
                        int64_t groups, int64_t rows, int64_t n) {
  using Bits = typename S::Bits;
  constexpr int kB = norm::kGradBlock;
  static_assert(kB == 32, "insert_leaf holds the subtrees of a run of 32");
  const int64_t c0 = (int64_t{blockIdx.x} * kLanes + threadIdx.x) * kVec;
  if (c0 >= n) return;
  // Every row's column c0 is vector aligned when n is a multiple of kVec and the bases are.
  const bool vec = n % kVec == 0 && dm::vec_aligned<Bits>(x) && dm::vec_aligned<Bits>(g);
  const bool out_vec =
      n % kVec == 0 && dm::vec_aligned<float>(pw) && (pb == nullptr || dm::vec_aligned<float>(pb));
  const int64_t blocks = (rows + kB - 1) / kB;
  for (int64_t q = blockIdx.y; q < groups * blocks; q += gridDim.y) {
    const int64_t grp = q / blocks, blk = q % blocks;
    const int64_t row0 = grp * rows + blk * kB;
    const int m = static_cast<int>(min(int64_t{kB}, rows - blk * kB));
    const Bits* xr = x + row0 * n;
    const Bits* gr = g + row0 * n;
    float sw[6][kVec], sb[6][kVec];
    auto leaf = [&](int i) {
      float xv[kVec], gv[kVec];
      dm::load_lane<S>(xr + i * n, c0, n, vec, 0.0f, xv);
      dm::load_lane<S>(gr + i * n, c0, n, vec, 0.0f, gv);
      const float mean = stats[2 * (row0 + i)], rstd = stats[2 * (row0 + i) + 1];
#pragma unroll
      for (int j = 0; j < kVec; ++j) xv[j] = norm::scale_grad_term(xv[j], gv[j], mean, rstd);
      insert_leaf<kVec>(i, xv, sw);
      if (pb != nullptr) insert_leaf<kVec>(i, gv, sb);
    };
    if (m == kB) {  // a whole run: no guard, so the loads of many tokens are in flight at once
#pragma unroll
      for (int i = 0; i < kB; ++i) leaf(i);
    } else {
#pragma unroll
      for (int i = 0; i < kB; ++i) {
        if (i < m) leaf(i);
      }
    }
    float out[kVec];
    fold_pending<kVec>(m, sw, out);
    dm::store_lane<F32Storage>(reinterpret_cast<uint32_t*>(pw + q * n), c0, n, out_vec, out);
    if (pb != nullptr) {
      fold_pending<kVec>(m, sb, out);
      dm::store_lane<F32Storage>(reinterpret_cast<uint32_t*>(pb + q * n), c0, n, out_vec, out);
    }
  }
}

// One upper level of the tree: per (group, aligned run of kGradBlock partials, column), the run's
// subtree (block_tree over up to 32 partials, all loaded at once). in [G, count, n] -> out [G,
// ceil(count / 32), n]. Aligned runs of 32 nodes of one level are subtrees of the next, so
// repeating it until one partial is left walks exactly the padded tree over the partials.
__global__ void __launch_bounds__(kLanes)
    NormGradLevelKernel(const float* __restrict__ in, float* __restrict__ out, int64_t groups, int64_t count,
                        int64_t n) {
  constexpr int kB = norm::kGradBlock;
  const int64_t j = int64_t{blockIdx.x} * kLanes + threadIdx.x;
  if (j >= n) return;
  const int64_t runs = (count + kB - 1) / kB;
  for (int64_t q = blockIdx.y; q < groups * runs; q += gridDim.y) {
    const int64_t grp = q / runs, run = q % runs;
    const int m = static_cast<int>(min(int64_t{kB}, count - run * kB));
    const float* p = in + (grp * count + run * kB) * n + j;
    float v[kB];
#pragma unroll
    for (int i = 0; i < kB; ++i) v[i] = i < m ? p[i * n] : 0.0f;
    out[q * n + j] = norm::block_tree(v, m);
  }
}

unsigned RowGrid(int64_t rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t{current_sm_count()} * 32)));
}

// Whether every row of n elements and the parameter vectors are whole aligned vectors (n a multiple
// of kVec and aligned bases): then a row of exactly kSteps * kStep elements runs NormFwdKernel's /
// NormBwdKernel's kExact variant.
bool AllVectorAligned(int64_t n, std::initializer_list<const void*> bases) {
  if (n % kVec != 0) return false;
  for (const void* p : bases) {
    if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  }
  return true;
}

template <typename S>
void LaunchFwd(cudaStream_t stream, const void* x, const float* w, const float* b, void* y, float* stats,
               const RowArgs& a, float eps, bool center, bool has_bias) {
  using Bits = typename S::Bits;
  const auto* xp = static_cast<const Bits*>(x);
  auto* yp = static_cast<Bits*>(y);
  const unsigned grid = RowGrid(a.rows);
  const bool aligned = AllVectorAligned(a.n, {x, y, w, b});
#define JAXDET_NORM_FWD(STEPS)                                                                                 \
  if (aligned && a.n == (STEPS) * kStep) {                                                                     \
    NormFwdKernel<S, STEPS, true><<<grid, kLanes, 0, stream>>>(xp, w, b, yp, stats, a, eps, center, has_bias); \
  } else {                                                                                                     \
    NormFwdKernel<S, STEPS><<<grid, kLanes, 0, stream>>>(xp, w, b, yp, stats, a, eps, center, has_bias);       \
  }
  if (a.n <= 1 * kStep) {
    JAXDET_NORM_FWD(1)
  } else if (a.n <= 2 * kStep) {
    JAXDET_NORM_FWD(2)
  } else if (a.n <= 4 * kStep) {
    JAXDET_NORM_FWD(4)
  } else if (a.n <= 8 * kStep) {
    JAXDET_NORM_FWD(8)
  } else {
    NormFwdKernel<S, 0><<<grid, kLanes, 0, stream>>>(xp, w, b, yp, stats, a, eps, center, has_bias);
  }
#undef JAXDET_NORM_FWD
}

template <typename S>
void LaunchBwd(cudaStream_t stream, const void* x, const float* w, const float* stats, const void* g, void* dx,
               const RowArgs& a, bool center) {
  using Bits = typename S::Bits;
  const auto* xp = static_cast<const Bits*>(x);
  const auto* gp = static_cast<const Bits*>(g);
  auto* dp = static_cast<Bits*>(dx);
  const unsigned grid = RowGrid(a.rows);
  const bool aligned = AllVectorAligned(a.n, {x, w, g, dx});
#define JAXDET_NORM_BWD(STEPS)                                                                   \
  if (aligned && a.n == (STEPS) * kStep) {                                                       \
    NormBwdKernel<S, STEPS, true><<<grid, kLanes, 0, stream>>>(xp, w, stats, gp, dp, a, center); \
  } else {                                                                                       \
    NormBwdKernel<S, STEPS><<<grid, kLanes, 0, stream>>>(xp, w, stats, gp, dp, a, center);       \
  }
  if (a.n <= 1 * kStep) {
    JAXDET_NORM_BWD(1)
  } else if (a.n <= 2 * kStep) {
    JAXDET_NORM_BWD(2)
  } else if (a.n <= 4 * kStep) {
    JAXDET_NORM_BWD(4)
  } else {
    NormBwdKernel<S, 0><<<grid, kLanes, 0, stream>>>(xp, w, stats, gp, dp, a, center);
  }
#undef JAXDET_NORM_BWD
}

ffi::Error Dims(const ffi::AnyBuffer& x, RowArgs& a, const char* op) {
  const auto d = x.dimensions();
  if (d.size() != 3) return ffi::Error::InvalidArgument(std::string(op) + ": x must be [G, R, n]");
  a.rows = d[0] * d[1];
  a.rows_per_group = d[1];
  a.n = d[2];
  return ffi::Error::Success();
}

int64_t ParamStride(const ffi::Buffer<ffi::F32>& p, const ffi::AnyBuffer& x) {
  const auto d = p.dimensions();
  const auto xd = x.dimensions();
  if (d.size() != 2 || d[1] != xd[2]) return -1;
  if (d[0] == 1) return 0;
  if (d[0] == xd[0]) return xd[2];
  return -1;
}

ffi::Error NormFwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> b,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> stats, float eps,
                       bool center) {
  constexpr const char* kOp = "jaxdet_norm_fwd";
  RowArgs a{};
  if (auto err = Dims(x, a, kOp); !err.success()) return err;
  const bool has_bias = b.element_count() > 0;
  a.w_stride = ParamStride(w, x);
  a.b_stride = has_bias ? ParamStride(b, x) : 0;
  if (a.w_stride < 0 || a.b_stride < 0) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": scale/bias must be [1 or G, n]");
  }
  if (a.rows == 0 || a.n == 0) return ffi::Error::Success();
  const float* bp = has_bias ? b.typed_data() : nullptr;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        LaunchFwd<S>(stream, x.untyped_data(), w.typed_data(), bp, y->untyped_data(),
                                     stats->typed_data(), a, eps, center, has_bias));
  return last_launch_error(kOp);
}

ffi::Error NormBwdCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> stats,
                       ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> dx, bool center) {
  constexpr const char* kOp = "jaxdet_norm_bwd";
  RowArgs a{};
  if (auto err = Dims(x, a, kOp); !err.success()) return err;
  a.w_stride = ParamStride(w, x);
  if (a.w_stride < 0) return ffi::Error::InvalidArgument(std::string(kOp) + ": scale must be [1 or G, n]");
  if (g.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(kOp) + ": g must have x's dtype");
  if (a.rows == 0 || a.n == 0) return ffi::Error::Success();
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        LaunchBwd<S>(stream, x.untyped_data(), w.typed_data(), stats.typed_data(),
                                     g.untyped_data(), dx->untyped_data(), a, center));
  return last_launch_error(kOp);
}

template <typename S>
void LaunchParamGrad(cudaStream_t stream, const void* x, const float* stats, const void* g, float* dw, float* db,
                     float* ws_w, float* ws_b, int64_t groups, int64_t rows, int64_t n) {
  using Bits = typename S::Bits;
  // Level 0 reduces runs of kGradBlock tokens, each later level runs of kGradBlock partials, until
  // one is left; it goes to the result, the levels before it to consecutive workspace regions.
  int64_t count = (rows + norm::kGradBlock - 1) / norm::kGradBlock;
  float* pw = count == 1 ? dw : ws_w;
  float* pb = db == nullptr ? nullptr : count == 1 ? db : ws_b;
  const unsigned columns = static_cast<unsigned>((n + kLanes - 1) / kLanes);
  const unsigned vec_columns = static_cast<unsigned>((n + kLanes * kVec - 1) / (kLanes * kVec));
  NormParamGradKernel<S>
      <<<dim3(vec_columns, static_cast<unsigned>(std::min<int64_t>(groups * count, 65535))), kLanes, 0, stream>>>(
          static_cast<const Bits*>(x), stats, static_cast<const Bits*>(g), pw, pb, groups, rows, n);
  while (count > 1) {
    const int64_t next = (count + norm::kGradBlock - 1) / norm::kGradBlock;
    float* nw = next == 1 ? dw : pw + groups * count * n;
    float* nb = pb == nullptr ? nullptr : next == 1 ? db : pb + groups * count * n;
    const dim3 grid(columns, static_cast<unsigned>(std::min<int64_t>(groups * next, 65535)));
    NormGradLevelKernel<<<grid, kLanes, 0, stream>>>(pw, nw, groups, count, n);
    if (pb != nullptr) NormGradLevelKernel<<<grid, kLanes, 0, stream>>>(pb, nb, groups, count, n);
    pw = nw;
    pb = nb;
    count = next;
  }
}

// dw, db [G, n] (db [G, 0] without a bias); workspaces of norm::grad_workspace_rows(T) * G * n
// floats (ws_b only with a bias): every level of partials but the last.
ffi::Error NormParamGradCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> stats, ffi::AnyBuffer g,
                             ffi::Result<ffi::Buffer<ffi::F32>> dw, ffi::Result<ffi::Buffer<ffi::F32>> db,
                             ffi::Result<ffi::Buffer<ffi::F32>> ws_w, ffi::Result<ffi::Buffer<ffi::F32>> ws_b) {
  constexpr const char* kOp = "jaxdet_norm_param_grad";
  const auto d = x.dimensions();
  if (d.size() != 3) return ffi::Error::InvalidArgument(std::string(kOp) + ": x must be [G, T, n]");
  if (g.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(kOp) + ": g must have x's dtype");
  const int64_t groups = d[0], rows = d[1], n = d[2];
  float* bias = db->element_count() > 0 ? db->typed_data() : nullptr;
  if (groups == 0 || n == 0) return ffi::Error::Success();
  if (rows == 0) {
    if (auto err = cudaMemsetAsync(dw->typed_data(), 0, dw->size_bytes(), stream); err != cudaSuccess)
      return cuda_error(kOp, err);
    if (bias != nullptr) {
      if (auto err = cudaMemsetAsync(bias, 0, db->size_bytes(), stream); err != cudaSuccess)
        return cuda_error(kOp, err);
    }
    return ffi::Error::Success();
  }
  const int64_t need = groups * norm::grad_workspace_rows(rows) * n;
  if (static_cast<int64_t>(ws_w->element_count()) < need ||
      (bias != nullptr && static_cast<int64_t>(ws_b->element_count()) < need)) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": workspace too small");
  }
  if ((n + kLanes - 1) / kLanes > 0x7FFFFFFF)
    return ffi::Error::InvalidArgument(std::string(kOp) + ": n too large");
  JAXDET_DISPATCH_FLOAT(
      x.element_type(), kOp, "x",
      LaunchParamGrad<S>(stream, x.untyped_data(), stats.typed_data(), g.untyped_data(), dw->typed_data(), bias,
                         ws_w->typed_data(), ws_b->typed_data(), groups, rows, n));
  return last_launch_error(kOp);
}

}  // namespace

// Kernels and cudaMemsetAsync on XLA's stream only (the workspaces are results), so XLA may
// record every handler into its command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_norm_fwd_cuda, NormFwdCuda,
                              norm::bind_fwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_norm_bwd_cuda, NormBwdCuda,
                              norm::bind_bwd(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_norm_param_grad_cuda, NormParamGradCuda,
                              norm::bind_param_grad(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxdet
