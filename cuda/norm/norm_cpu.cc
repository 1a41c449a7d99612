// CPU targets of RMSNorm / LayerNorm: forward, input gradient, and the parameter-gradient partials.
// Plain loops walking the canonical order of common/det_math.h and the formulas of norm_math.h, so
// the bits equal the CUDA kernels'.
//
// Layouts (jaxdet/norm.py): x, y, g, dx [G, R, n]; w, b float32 [Gw, n] with Gw in {1, G} (b may be
// empty: no bias); stats float32 [G, R, 2] = (mean, rstd) per row (mean = +0 for RMSNorm);
// parameter gradients float32 [G, n] (the tree over each group's R tokens).
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/det_math.h"
#include "common/ffi_common.h"
#include "norm/norm_ffi.h"
#include "norm/norm_math.h"

namespace jaxdet {
namespace {

namespace dm = ::jaxdet::detmath;

struct Shape {
  int64_t groups, rows, n;  // x is [groups, rows, n]
};

ffi::Error ShapeOf(const ffi::AnyBuffer& x, Shape& s, const char* op) {
  const auto d = x.dimensions();
  if (d.size() != 3) return ffi::Error::InvalidArgument(std::string(op) + ": x must be [G, R, n]");
  s = Shape{d[0], d[1], d[2]};
  return ffi::Error::Success();
}

// Group stride of a parameter [Gp, n] (Gp in {1, G}); -1 if its shape does not fit.
int64_t ParamStride(const ffi::Buffer<ffi::F32>& p, const Shape& s) {
  const auto d = p.dimensions();
  if (d.size() != 2 || d[1] != s.n) return -1;
  if (d[0] == 1) return 0;
  if (d[0] == s.groups) return s.n;
  return -1;
}

template <typename S>
void FwdRows(const ffi::AnyBuffer& x, const float* w, int64_t ws, const float* b, int64_t bs, bool has_bias,
             void* y, float* stats, const Shape& s, float eps, bool center) {
  using Bits = typename S::Bits;
  const Bits* xp = static_cast<const Bits*>(x.untyped_data());
  Bits* yp = static_cast<Bits*>(y);
  const int64_t n = s.n;
  for (int64_t g = 0; g < s.groups; ++g) {
    const float* wr = w + g * ws;
    const float* br = has_bias ? b + g * bs : nullptr;
    for (int64_t r = 0; r < s.rows; ++r) {
      const int64_t row = g * s.rows + r;
      const Bits* xr = xp + row * n;
      float mean = 0.0f;
      if (center) {
        dm::HostLanes lanes;
        for (int64_t e = 0; e < n; ++e) lanes.add_term(e, S::load(xr[e]));
        mean = norm::mean_of(lanes.tree(), n);
      }
      dm::HostLanes sq;
      for (int64_t e = 0; e < n; ++e) sq.add_term(e, norm::centered_square(S::load(xr[e]), mean));
      const float rstd = norm::rstd_of(sq.tree(), n, eps);
      stats[2 * row] = mean;
      stats[2 * row + 1] = rstd;
      Bits* yr = yp + row * n;
      for (int64_t e = 0; e < n; ++e) {
        yr[e] = S::store(norm::forward(S::load(xr[e]), mean, rstd, wr[e], has_bias ? br[e] : 0.0f, has_bias));
      }
    }
  }
}

ffi::Error NormFwdCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> b,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> stats, float eps,
                      bool center) {
  constexpr const char* kOp = "jaxdet_norm_fwd";
  Shape s;
  if (auto err = ShapeOf(x, s, kOp); !err.success()) return err;
  const bool has_bias = b.element_count() > 0;
  const int64_t ws = ParamStride(w, s);
  const int64_t bs = has_bias ? ParamStride(b, s) : 0;
  if (ws < 0 || bs < 0) return ffi::Error::InvalidArgument(std::string(kOp) + ": scale/bias must be [1 or G, n]");
  if (s.n == 0) return ffi::Error::Success();
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        FwdRows<S>(x, w.typed_data(), ws, b.typed_data(), bs, has_bias, y->untyped_data(),
                                   stats->typed_data(), s, eps, center));
  return ffi::Error::Success();
}

template <typename S>
void BwdRows(const void* x, const float* w, int64_t ws, const float* stats, const void* g, void* dx,
             const Shape& s, bool center) {
  using Bits = typename S::Bits;
  const Bits* xp = static_cast<const Bits*>(x);
  const Bits* gp = static_cast<const Bits*>(g);
  Bits* dp = static_cast<Bits*>(dx);
  const int64_t n = s.n;
  for (int64_t grp = 0; grp < s.groups; ++grp) {
    const float* wr = w + grp * ws;
    for (int64_t r = 0; r < s.rows; ++r) {
      const int64_t row = grp * s.rows + r;
      const Bits* xr = xp + row * n;
      const Bits* gr = gp + row * n;
      const float mean = stats[2 * row], rstd = stats[2 * row + 1];
      dm::HostLanes sum_gw, sum_gwx;
      for (int64_t e = 0; e < n; ++e) {
        const float gw = norm::grad_scaled(S::load(gr[e]), wr[e]);
        if (center) sum_gw.add_term(e, gw);
        sum_gwx.add_term(e, dm::mul(gw, norm::normalized(S::load(xr[e]), mean, rstd)));
      }
      const float ma = center ? norm::mean_of(sum_gw.tree(), n) : 0.0f;
      const float mb = norm::mean_of(sum_gwx.tree(), n);
      Bits* dr = dp + row * n;
      for (int64_t e = 0; e < n; ++e) {
        dr[e] = S::store(norm::backward(S::load(xr[e]), S::load(gr[e]), wr[e], mean, rstd, ma, mb, center));
      }
    }
  }
}

ffi::Error NormBwdCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> stats, ffi::AnyBuffer g,
                      ffi::Result<ffi::AnyBuffer> dx, bool center) {
  constexpr const char* kOp = "jaxdet_norm_bwd";
  Shape s;
  if (auto err = ShapeOf(x, s, kOp); !err.success()) return err;
  const int64_t ws = ParamStride(w, s);
  if (ws < 0) return ffi::Error::InvalidArgument(std::string(kOp) + ": scale must be [1 or G, n]");
  if (g.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(kOp) + ": g must have x's dtype");
  if (s.n == 0) return ffi::Error::Success();
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(x.element_type(), kOp, "x",
                        BwdRows<S>(x.untyped_data(), w.typed_data(), ws, stats.typed_data(), g.untyped_data(),
                                   dx->untyped_data(), s, center));
  return ffi::Error::Success();
}

// The canonical tree over the rows of rows[0 .. m) (m <= kGradBlock rows of n floats) in place,
// as norm::block_tree walks it for one column: at stride s = 1, 2, 4, ..., row i (a multiple of
// 2s) += row i + s when that row holds a token.
void BlockTreeRows(std::vector<float>& rows, int m, int64_t n) {
  for (int s = 1; s < norm::kGradBlock; s *= 2) {
    for (int i = 0; i + s < m; i += 2 * s) {
      float* left = rows.data() + i * n;
      const float* right = rows.data() + (i + s) * n;
      for (int64_t j = 0; j < n; ++j) left[j] = dm::add(left[j], right[j]);
    }
  }
}

// The canonical tree over a sequence of vectors, walked left to right with a stack of complete
// subtrees (detmath::tree_fold's walk, elementwise).
class VectorTree {
 public:
  void push(std::vector<float> node) {
    int64_t count = 1;
    while (!sizes_.empty() && sizes_.back() == count) {
      std::vector<float>& left = nodes_.back();
      for (size_t j = 0; j < node.size(); ++j) left[j] = dm::add(left[j], node[j]);
      node.swap(left);
      nodes_.pop_back();
      sizes_.pop_back();
      count *= 2;
    }
    nodes_.push_back(std::move(node));
    sizes_.push_back(count);
  }
  // The root: the stack folded from the top (the padded tree's right spine).
  void root(float* out) {
    std::vector<float> acc = std::move(nodes_.back());
    for (size_t k = nodes_.size() - 1; k-- > 0;) {
      for (size_t j = 0; j < acc.size(); ++j) acc[j] = dm::add(nodes_[k][j], acc[j]);
    }
    std::copy(acc.begin(), acc.end(), out);
  }

 private:
  std::vector<std::vector<float>> nodes_;
  std::vector<int64_t> sizes_;
};

// Per group: dscale (and dbias) = the canonical tree over tokens of g * xhat (and of g), computed
// as the CUDA kernels do: aligned blocks of kGradBlock tokens, then the tree over the blocks.
template <typename S>
void ParamGrad(const void* x, const float* stats, const void* g, float* dw, float* db, const Shape& s) {
  using Bits = typename S::Bits;
  const Bits* xp = static_cast<const Bits*>(x);
  const Bits* gp = static_cast<const Bits*>(g);
  const int64_t n = s.n;
  std::vector<float> tw(norm::kGradBlock * n), tb(db ? norm::kGradBlock * n : 0);
  for (int64_t grp = 0; grp < s.groups; ++grp) {
    VectorTree tree_w, tree_b;
    for (int64_t t0 = 0; t0 < s.rows; t0 += norm::kGradBlock) {
      const int m = static_cast<int>(std::min<int64_t>(norm::kGradBlock, s.rows - t0));
      for (int i = 0; i < m; ++i) {
        const int64_t row = grp * s.rows + t0 + i;
        const float mean = stats[2 * row], rstd = stats[2 * row + 1];
        for (int64_t j = 0; j < n; ++j) {
          const float gv = S::load(gp[row * n + j]);
          tw[i * n + j] = norm::scale_grad_term(S::load(xp[row * n + j]), gv, mean, rstd);
          if (db) tb[i * n + j] = gv;
        }
      }
      BlockTreeRows(tw, m, n);
      tree_w.push(std::vector<float>(tw.begin(), tw.begin() + n));
      if (db) {
        BlockTreeRows(tb, m, n);
        tree_b.push(std::vector<float>(tb.begin(), tb.begin() + n));
      }
    }
    tree_w.root(dw + grp * n);
    if (db) tree_b.root(db + grp * n);
  }
}

// dw, db [G, n] (db [G, 0] without a bias); the workspaces are the CUDA kernels' (unused here).
ffi::Error NormParamGradCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> stats, ffi::AnyBuffer g,
                            ffi::Result<ffi::Buffer<ffi::F32>> dw, ffi::Result<ffi::Buffer<ffi::F32>> db,
                            ffi::Result<ffi::Buffer<ffi::F32>> /*ws_w*/,
                            ffi::Result<ffi::Buffer<ffi::F32>> /*ws_b*/) {
  constexpr const char* kOp = "jaxdet_norm_param_grad";
  Shape s;
  if (auto err = ShapeOf(x, s, kOp); !err.success()) return err;
  if (g.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(kOp) + ": g must have x's dtype");
  float* bias = db->element_count() > 0 ? db->typed_data() : nullptr;
  if (s.n == 0 || s.groups == 0) return ffi::Error::Success();
  if (s.rows == 0) {
    std::fill(dw->typed_data(), dw->typed_data() + dw->element_count(), 0.0f);
    if (bias) std::fill(bias, bias + db->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(
      x.element_type(), kOp, "x",
      ParamGrad<S>(x.untyped_data(), stats.typed_data(), g.untyped_data(), dw->typed_data(), bias, s));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_norm_fwd_cpu, NormFwdCpu, norm::bind_fwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_norm_bwd_cpu, NormBwdCpu, norm::bind_bwd(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_norm_param_grad_cpu, NormParamGradCpu,
                              norm::bind_param_grad(ffi::Ffi::Bind()));

}  // namespace jaxdet
