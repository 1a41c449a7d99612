// CPU target of jaxdet_reduce: x [A, K, B] -> out [A, B], the canonical sum over K (reduce_ffi.h,
// docs/reduce.md). Plain loops that do the rule's float32 adds in the rule's order (built with
// -ffp-contract=off, IEEE subnormals), so the bits equal the CUDA kernels' and the NumPy reference.
//
// Work items: B > 1, (a, a block of kCols columns): the columns' chains run side by side (the inner
// loop over contiguous columns vectorizes; each column's adds stay in ascending k). B == 1, a block
// of kRows rows: independent chains interleaved. An item walks its chunks in order and combines the
// chunk partials by the canonical tree as they come (a stack of complete subtrees, no scratch), so
// items never share a partial and the bits never depend on which thread runs which item.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/det_math.h"
#include "common/ffi_common.h"
#include "common/parallel.h"
#include "reduce/reduce_ffi.h"

namespace jaxdet {
namespace {

namespace dm = ::jaxdet::detmath;
using reduce::Dims;

constexpr int kCols = 64;  // columns per item when B > 1
constexpr int kRows = 8;   // rows per item when B == 1
constexpr int kLevels = 64;  // tree stack depth: more than log2(chunks) + 1 for any int64 K
constexpr int64_t kMinElementsPerWorker = int64_t{1} << 16;

// The canonical tree over a sequence of partial vectors of width w <= W, fed left to right:
// detmath::tree_fold's walk, elementwise (a new partial merges with the complete subtrees of its
// size on the stack, left + right; at the end the stack folds from the top).
template <int W>
class PartialTree {
 public:
  explicit PartialTree(int w) : w_(w) {}
  void push(float (&p)[W]) {
    int64_t count = 1;
    while (top_ > 0 && size_[top_ - 1] == count) {
      const float* left = node_[top_ - 1];
      for (int j = 0; j < w_; ++j) p[j] = dm::add(left[j], p[j]);
      count *= 2;
      --top_;
    }
    std::memcpy(node_[top_], p, sizeof(float) * w_);
    size_[top_++] = count;
  }
  void root(float (&r)[W]) const {
    std::memcpy(r, node_[top_ - 1], sizeof(float) * w_);
    for (int i = top_ - 2; i >= 0; --i) {
      for (int j = 0; j < w_; ++j) r[j] = dm::add(node_[i][j], r[j]);
    }
  }

 private:
  int w_;
  int top_ = 0;
  float node_[kLevels][W];
  int64_t size_[kLevels];
};

// Output columns [b0, b0 + w) of row a (B > 1).
template <typename S, typename O>
void ColumnItem(const typename S::Bits* x, typename O::Bits* out, const Dims& d, int64_t a, int64_t b0) {
  using Bits = typename S::Bits;
  const int w = static_cast<int>(std::min<int64_t>(kCols, d.B - b0));
  PartialTree<kCols> tree(w);
  float acc[kCols];
  for (int64_t c = 0; c < d.chunks; ++c) {
    const int64_t k0 = c * d.chunk, k1 = std::min(d.K, k0 + d.chunk);
    for (int j = 0; j < kCols; ++j) acc[j] = 0.0f;
    const Bits* p = x + (a * d.K + k0) * d.B + b0;
    if (w == kCols) {
      for (int64_t k = k0; k < k1; ++k, p += d.B) {
        for (int j = 0; j < kCols; ++j) acc[j] = dm::add(acc[j], S::load(p[j]));
      }
    } else {
      for (int64_t k = k0; k < k1; ++k, p += d.B) {
        for (int j = 0; j < w; ++j) acc[j] = dm::add(acc[j], S::load(p[j]));
      }
    }
    tree.push(acc);
  }
  tree.root(acc);
  for (int j = 0; j < w; ++j) out[a * d.B + b0 + j] = O::store(acc[j]);
}

// Rows [a0, a0 + n) (B == 1).
template <typename S, typename O>
void RowItem(const typename S::Bits* x, typename O::Bits* out, const Dims& d, int64_t a0) {
  using Bits = typename S::Bits;
  const int n = static_cast<int>(std::min<int64_t>(kRows, d.A - a0));
  PartialTree<kRows> tree(n);
  float acc[kRows];
  const Bits* row[kRows];
  for (int r = 0; r < kRows; ++r) row[r] = x + (a0 + std::min(r, n - 1)) * d.K;
  for (int64_t c = 0; c < d.chunks; ++c) {
    const int64_t k0 = c * d.chunk, k1 = std::min(d.K, k0 + d.chunk);
    for (int r = 0; r < kRows; ++r) acc[r] = 0.0f;
    if (n == kRows) {
      for (int64_t k = k0; k < k1; ++k) {
        for (int r = 0; r < kRows; ++r) acc[r] = dm::add(acc[r], S::load(row[r][k]));
      }
    } else {
      for (int64_t k = k0; k < k1; ++k) {
        for (int r = 0; r < n; ++r) acc[r] = dm::add(acc[r], S::load(row[r][k]));
      }
    }
    tree.push(acc);
  }
  tree.root(acc);
  for (int r = 0; r < n; ++r) out[a0 + r] = O::store(acc[r]);
}

template <typename S, typename O>
void ReduceAll(const void* xp, void* op, const Dims& d, ffi::ThreadPool& pool) {
  const auto* x = static_cast<const typename S::Bits*>(xp);
  auto* out = static_cast<typename O::Bits*>(op);
  const int64_t col_blocks = (d.B + kCols - 1) / kCols;
  const bool rows = d.B == 1;
  const int64_t items = rows ? (d.A + kRows - 1) / kRows : d.A * col_blocks;
  const int64_t elements = d.A * d.K * d.B;
  // The caller is one of the workers; small problems stay on it.
  const int64_t workers = std::max<int64_t>(
      1, std::min({items, static_cast<int64_t>(pool.num_threads()), elements / kMinElementsPerWorker + 1}));
  parallel_for(pool, items, workers, [&](int64_t item) {
    if (rows) {
      RowItem<S, O>(x, out, d, item * kRows);
    } else {
      ColumnItem<S, O>(x, out, d, item / col_blocks, (item % col_blocks) * kCols);
    }
  });
}

ffi::Error ReduceCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out, int64_t chunk) {
  constexpr const char* kOp = "jaxdet_reduce";
  Dims d;
  if (auto err = reduce::dims_of(x, *out, chunk, d, kOp); !err.success()) return err;
  return reduce::dispatch(x.element_type(), out->element_type(), kOp, [&](auto s, auto o) {
    using S = decltype(s);
    using O = decltype(o);
    if (d.outputs() == 0) return ffi::Error::Success();
    if (d.K == 0) {  // nothing to add: +0 (all-zero bits in every dtype)
      std::memset(out->untyped_data(), 0, sizeof(typename O::Bits) * d.outputs());
      return ffi::Error::Success();
    }
    IeeeSubnormalsScope ieee;  // parallel_for gives its tasks the caller's floating-point mode
    ReduceAll<S, O>(x.untyped_data(), out->untyped_data(), d, pool);
    return ffi::Error::Success();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_reduce_cpu, ReduceCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // x [A, K, B]
                                  .Ret<ffi::AnyBuffer>()  // out [A, B]
                                  .Attr<int64_t>("chunk"));

}  // namespace jaxdet
