// CPU targets of softmax, log_softmax and cross-entropy (forward and backward), and of the
// deterministic math functions themselves (a test target). Plain loops walking the segments,
// lanes and trees of softmax_math.h / det_math.h, so the bits equal the CUDA kernels'.
//
// Layouts (jaxdet/softmax.py): x, y, g, dx [R, n]; stats float32 [R, stat_width(n)] = (M, S, the
// segments' maxima when there are several) per row (softmax_math.h); labels
// int32 [R]; per-row losses and their cotangents float32 [R]. The workspace results are used by the
// CUDA kernels only (rows of several segments); here they are left untouched.
#include <cstdint>
#include <string>
#include <vector>

#include "common/det_math.h"
#include "common/ffi_common.h"
#include "softmax/softmax_ffi.h"
#include "softmax/softmax_math.h"

namespace jaxdet {
namespace {

namespace dm = ::jaxdet::detmath;
namespace sm = ::jaxdet::softmax;

// The row sum of term(e) by segments, lanes and the segment tree.
template <typename Term>
float RowSum(int64_t n, Term term) {
  return dm::tree_fold<float>(
      sm::segment_count(n),
      [&](int64_t seg) {
        const int64_t len = sm::segment_length(n, seg);
        dm::HostLanes lanes;
        for (int64_t e = 0; e < len; ++e) lanes.add_term(e, term(seg * sm::kSegment + e));
        return lanes.tree();
      },
      [](float a, float b) { return dm::add(a, b); });
}

// Writes a row's statistics (stat_width(n) floats: M, S and, with several segments, each m_k).
template <typename S>
void RowStats(const typename S::Bits* x, int64_t n, float* st) {
  const int64_t segments = sm::segment_count(n);
  float M = dm::neg_inf();
  for (int64_t seg = 0; seg < segments; ++seg) {
    float m = dm::neg_inf();
    for (int64_t e = seg * sm::kSegment; e < seg * sm::kSegment + sm::segment_length(n, seg); ++e) {
      m = dm::max(m, S::load(x[e]));
    }
    if (segments > 1) st[2 + seg] = m;
    M = dm::max(M, m);
  }
  st[0] = M;
  st[1] = dm::tree_fold<float>(
      segments,
      [&](int64_t seg) {
        const float m = segments > 1 ? st[2 + seg] : M;
        dm::HostLanes lanes;
        for (int64_t e = 0; e < sm::segment_length(n, seg); ++e) {
          lanes.add_term(e, sm::exp_term(S::load(x[seg * sm::kSegment + e]), m));
        }
        return sm::segment_term(lanes.tree(), m, M);
      },
      [](float a, float b) { return dm::add(a, b); });
}

// Every segment's (m_k, w_k) of a row from its statistics.
std::vector<sm::SegmentScale> SegmentScales(const float* st, int64_t n) {
  const int64_t segments = sm::segment_count(n);
  std::vector<sm::SegmentScale> scales(segments);
  for (int64_t seg = 0; seg < segments; ++seg) scales[seg] = sm::segment_scale(st, seg, segments);
  return scales;
}

// p of element e of a row.
template <typename S>
float Prob(const typename S::Bits* x, const std::vector<sm::SegmentScale>& scales, int64_t e) {
  const sm::SegmentScale& sc = scales[e / sm::kSegment];
  return sm::prob(S::load(x[e]), sc.m, sc.w);
}

template <typename S>
void SoftmaxRows(const void* x, void* y, float* stats, int64_t rows, int64_t n, int32_t mode) {
  using Bits = typename S::Bits;
  for (int64_t r = 0; r < rows; ++r) {
    const Bits* xr = static_cast<const Bits*>(x) + r * n;
    Bits* yr = static_cast<Bits*>(y) + r * n;
    float* st = stats + r * sm::stat_width(n);
    RowStats<S>(xr, n, st);
    if (mode == sm::kSoftmax) {
      const std::vector<sm::SegmentScale> scales = SegmentScales(st, n);
      for (int64_t e = 0; e < n; ++e) yr[e] = S::store(Prob<S>(xr, scales, e));
    } else {
      const float log_s = dm::log(st[1]);
      for (int64_t e = 0; e < n; ++e) yr[e] = S::store(sm::log_prob(S::load(xr[e]), st[0], log_s));
    }
  }
}

ffi::Error SoftmaxFwdCpu(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> stats,
                         ffi::Result<ffi::Buffer<ffi::F32>> /*workspace*/, int32_t mode) {
  constexpr const char* kOp = "jaxdet_softmax_fwd";
  int64_t rows, n;
  if (auto err = sm::rows_of(x, rows, n, kOp); !err.success()) return err;
  if (rows == 0 || n == 0) return ffi::Error::Success();
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        SoftmaxRows<S>(x.untyped_data(), y->untyped_data(), stats->typed_data(), rows, n, mode));
  return ffi::Error::Success();
}

template <typename S>
void SoftmaxBwdRows(const void* x, const float* stats, const void* g, void* dx, int64_t rows, int64_t n,
                    int32_t mode) {
  using Bits = typename S::Bits;
  for (int64_t r = 0; r < rows; ++r) {
    const Bits* xr = static_cast<const Bits*>(x) + r * n;
    const Bits* gr = static_cast<const Bits*>(g) + r * n;
    Bits* dr = static_cast<Bits*>(dx) + r * n;
    const std::vector<sm::SegmentScale> scales = SegmentScales(stats + r * sm::stat_width(n), n);
    const float total =
        RowSum(n, [&](int64_t e) { return sm::bwd_term(S::load(gr[e]), Prob<S>(xr, scales, e), mode); });
    for (int64_t e = 0; e < n; ++e) {
      dr[e] = S::store(sm::bwd(S::load(gr[e]), Prob<S>(xr, scales, e), total, mode));
    }
  }
}

ffi::Error SoftmaxBwdCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> stats, ffi::AnyBuffer g,
                         ffi::Result<ffi::AnyBuffer> dx, ffi::Result<ffi::Buffer<ffi::F32>> /*workspace*/,
                         int32_t mode) {
  constexpr const char* kOp = "jaxdet_softmax_bwd";
  int64_t rows, n;
  if (auto err = sm::check_bwd_call(x, stats, g, rows, n, kOp); !err.success()) return err;
  if (rows == 0 || n == 0) return ffi::Error::Success();
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        SoftmaxBwdRows<S>(x.untyped_data(), stats.typed_data(), g.untyped_data(),
                                          dx->untyped_data(), rows, n, mode));
  return ffi::Error::Success();
}

template <typename S>
void XentRows(const void* x, const int32_t* labels, float* out, float* stats, int64_t rows, int64_t n,
              bool log_prob) {
  using Bits = typename S::Bits;
  for (int64_t r = 0; r < rows; ++r) {
    const Bits* xr = static_cast<const Bits*>(x) + r * n;
    float* st = stats + r * sm::stat_width(n);
    RowStats<S>(xr, n, st);
    const int32_t label = labels[r];
    const bool valid = label >= 0 && label < n;
    const float x_label = valid ? S::load(xr[label]) : 0.0f;
    const float log_s = dm::log(st[1]);
    out[r] = log_prob ? sm::label_log_prob(x_label, st[0], log_s, valid)
                      : sm::cross_entropy(x_label, st[0], log_s, valid);
  }
}

ffi::Error XentFwdCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> labels, ffi::Result<ffi::Buffer<ffi::F32>> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> stats, ffi::Result<ffi::Buffer<ffi::F32>> /*workspace*/,
                      bool log_prob) {
  constexpr const char* kOp = "jaxdet_xent_fwd";
  int64_t rows, n;
  if (auto err = sm::check_xent_fwd_call(x, labels, rows, n, kOp); !err.success()) return err;
  if (rows == 0) return ffi::Error::Success();
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        XentRows<S>(x.untyped_data(), labels.typed_data(), out->typed_data(), stats->typed_data(),
                                    rows, n, log_prob));
  return ffi::Error::Success();
}

template <typename S>
void XentBwdRows(const void* x, const int32_t* labels, const float* stats, const float* g, void* dx, int64_t rows,
                 int64_t n) {
  using Bits = typename S::Bits;
  for (int64_t r = 0; r < rows; ++r) {
    const Bits* xr = static_cast<const Bits*>(x) + r * n;
    Bits* dr = static_cast<Bits*>(dx) + r * n;
    const int32_t label = labels[r];
    const bool valid = label >= 0 && label < n;
    const std::vector<sm::SegmentScale> scales = SegmentScales(stats + r * sm::stat_width(n), n);
    const float gr = g[r];
    for (int64_t e = 0; e < n; ++e) {
      dr[e] = S::store(sm::xent_bwd(gr, Prob<S>(xr, scales, e), e == label, valid));
    }
  }
}

ffi::Error XentBwdCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> labels, ffi::Buffer<ffi::F32> stats,
                      ffi::Buffer<ffi::F32> g, ffi::Result<ffi::AnyBuffer> dx) {
  constexpr const char* kOp = "jaxdet_xent_bwd";
  int64_t rows, n;
  if (auto err = sm::rows_of(x, rows, n, kOp); !err.success()) return err;
  if (rows == 0 || n == 0) return ffi::Error::Success();
  if (auto err = sm::stats_fit(stats, rows, sm::stat_width(n), kOp); !err.success()) return err;
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        XentBwdRows<S>(x.untyped_data(), labels.typed_data(), stats.typed_data(), g.typed_data(),
                                       dx->untyped_data(), rows, n));
  return ffi::Error::Success();
}

// The deterministic math functions elementwise (op 0: exp, 1: log, 2: rsqrt, 3: exp_nonpositive),
// for the tests.
ffi::Error DetMathCpu(ffi::Buffer<ffi::F32> x, ffi::Result<ffi::Buffer<ffi::F32>> y, int32_t op) {
  IeeeSubnormalsScope ieee;
  const float* src = x.typed_data();
  float* dst = y->typed_data();
  const int64_t count = static_cast<int64_t>(x.element_count());
  for (int64_t i = 0; i < count; ++i) {
    const float v = src[i];
    dst[i] = dm::canonical(op == 0   ? dm::exp(v)
                           : op == 1 ? dm::log(v)
                           : op == 2 ? dm::rsqrt(v)
                                     : dm::exp_nonpositive(v));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_softmax_fwd_cpu, SoftmaxFwdCpu, sm::bind_softmax_fwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_softmax_bwd_cpu, SoftmaxBwdCpu, sm::bind_softmax_bwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_xent_fwd_cpu, XentFwdCpu, sm::bind_xent_fwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_xent_bwd_cpu, XentBwdCpu, sm::bind_xent_bwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_det_math_cpu, DetMathCpu, sm::bind_det_math(ffi::Ffi::Bind()));

}  // namespace jaxdet
