// CPU target of the segment sum (jaxdet_segment_sum): the canonical chunk tree of embed_math.h with
// plain loops, on XLA's intra-op thread pool. A work item is a block of segments of one batch
// element; each segment is computed alone, so which thread runs an item never changes a bit.
#include <algorithm>
#include <cstdint>

#include "common/det_math.h"
#include "common/ffi_common.h"
#include "common/parallel.h"
#include "embed/embed_ffi.h"
#include "embed/embed_math.h"

namespace jaxdet {
namespace embed {
namespace {

constexpr int kCols = 64;  // columns folded together (the tree's values: 5 KB on the stack)
constexpr int64_t kSegmentsPerItem = 32;

struct SegmentSumArgs {
  const void* data;
  const int32_t* sorted_ids;
  const int32_t* order;
  void* out;
  SegmentSumShape s;
};

// Columns [col0, col0 + cols) of segment v of batch element l.
template <typename In, typename Out>
void SegmentColumns(const SegmentSumArgs& a, int64_t l, int64_t v, int64_t col0, int cols) {
  const auto* data = static_cast<const typename In::Bits*>(a.data) + l * a.s.T * a.s.D + col0;
  const int32_t* order = a.order + l * a.s.T;
  const int32_t* sorted = a.sorted_ids + l * a.s.T;
  const int64_t begin = count_below(sorted, a.s.T, v), end = count_below(sorted, a.s.T, v + 1);
  auto* out = static_cast<typename Out::Bits*>(a.out) + (l * a.s.V + v) * a.s.D + col0;
  if (begin >= end) {
    for (int j = 0; j < cols; ++j) out[j] = Out::store(0.0f);
    return;
  }
  ChunkTree<kCols> tree;
  float acc[kCols] = {};
  int32_t chunk = static_cast<int32_t>(order[begin] / a.s.chunk_tokens);
  for (int64_t i = begin; i < end; ++i) {
    const int64_t t = order[i];
    const int32_t c = static_cast<int32_t>(t / a.s.chunk_tokens);
    if (c != chunk) {
      tree.push(chunk, acc);
      for (float& x : acc) x = 0.0f;
      chunk = c;
    }
    const auto* row = data + t * a.s.D;
    for (int j = 0; j < cols; ++j) acc[j] = detmath::add(acc[j], In::load(row[j]));
  }
  tree.push(chunk, acc);
  float root[kCols];
  tree.root(root);
  for (int j = 0; j < cols; ++j) out[j] = Out::store(root[j]);
}

template <typename In, typename Out>
void SegmentSumAll(const SegmentSumArgs& a, ffi::ThreadPool& pool) {
  const int64_t blocks = (a.s.V + kSegmentsPerItem - 1) / kSegmentsPerItem;
  const int64_t items = a.s.L * blocks;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(items, pool.num_threads()));
  parallel_for(pool, items, workers, [&a, blocks](int64_t item) {
    const int64_t l = item / blocks;
    const int64_t first = (item % blocks) * kSegmentsPerItem;
    const int64_t last = std::min(a.s.V, first + kSegmentsPerItem);
    for (int64_t v = first; v < last; ++v) {
      for (int64_t col0 = 0; col0 < a.s.D; col0 += kCols) {
        SegmentColumns<In, Out>(a, l, v, col0, static_cast<int>(std::min<int64_t>(kCols, a.s.D - col0)));
      }
    }
  });
}

ffi::Error SegmentSumCpu(ffi::ThreadPool pool, ffi::AnyBuffer data, ffi::Buffer<ffi::S32> sorted_ids,
                         ffi::Buffer<ffi::S32> order, ffi::Result<ffi::AnyBuffer> out, int64_t chunk_tokens) {
  SegmentSumShape s;
  if (auto err = check_segment_sum_args(data, sorted_ids, order, *out, chunk_tokens, s); !err.success())
    return err;
  if (s.L == 0 || s.V == 0 || s.D == 0) return ffi::Error::Success();
  const SegmentSumArgs args{data.untyped_data(), sorted_ids.typed_data(), order.typed_data(), out->untyped_data(),
                            s};
  IeeeSubnormalsScope ieee;  // parallel_for gives its tasks the caller's floating-point mode
  JAXDET_DISPATCH_SEGMENT_SUM(data.element_type(), out->element_type(), (SegmentSumAll<In, Out>(args, pool)));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace embed

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdet_segment_sum_cpu, embed::SegmentSumCpu,
    embed::bind_segment_sum_attrs(embed::bind_segment_sum_buffers(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

}  // namespace jaxdet
