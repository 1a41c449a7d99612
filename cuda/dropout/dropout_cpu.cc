// CPU targets of the Philox block function and of dropout. The math is the shared header's, so
// these produce the same bits as the CUDA kernels. Dropout runs on XLA's intra-op thread pool.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common/ffi_common.h"
#include "common/parallel.h"
#include "common/philox.h"
#include "dropout/dropout_ffi.h"

namespace jaxdet {
namespace {

ffi::Error PhiloxCpu(ffi::Buffer<ffi::U32> counters, ffi::Buffer<ffi::U32> keys, ffi::ResultBuffer<ffi::U32> out) {
  const int64_t groups = key_group_count(keys);
  const int64_t blocks = static_cast<int64_t>(counters.element_count() / 4);
  if (auto err = check_key_groups(blocks, groups, "jaxdet_philox4x32_10"); !err.success()) return err;
  const int64_t per_group = blocks / groups;
  const uint32_t* ctr = counters.typed_data();
  const uint32_t* key = keys.typed_data();
  uint32_t* dst = out->typed_data();
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t k0 = key[2 * g], k1 = key[2 * g + 1];
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      const uint32_t* c = ctr + 4 * b;
      const Philox4 r = philox4x32_10(c[0], c[1], c[2], c[3], k0, k1);
      std::memcpy(dst + 4 * b, r.v, sizeof(r.v));
    }
  }
  return ffi::Error::Success();
}

// Elements [begin, end) of one group, whose element i has global index offset + i. Whole Philox
// blocks are walked so each block is hashed once and all 4 of its words are used.
template <typename Storage>
void DropoutRange(const typename Storage::Bits* x, typename Storage::Bits* y, int64_t begin, int64_t end,
                  uint64_t offset, uint32_t k0, uint32_t k1, uint32_t drop_threshold, float scale) {
  int64_t i = begin;
  const uint64_t first = offset + static_cast<uint64_t>(begin);
  uint64_t block = first / 4;
  int lane = static_cast<int>(first % 4);
  while (i < end) {
    const Philox4 r = dropout_block(block, k0, k1);
    for (; lane < 4 && i < end; ++lane, ++i) {
      y[i] = dropout_element<Storage>(x[i], dropout_keep(r.v[lane], drop_threshold), scale);
    }
    lane = 0;
    ++block;
  }
}

// A strided layout (broadcast_dims, or a shard of a larger array): each element finds its mask
// index through the layout; consecutive elements usually share a Philox block, so the last block
// is kept.
template <typename Storage>
void DropoutRangeStrided(const typename Storage::Bits* x, typename Storage::Bits* y, int64_t begin, int64_t end,
                         const MaskLayout& layout, uint64_t offset, uint32_t k0, uint32_t k1,
                         uint32_t drop_threshold, float scale) {
  uint64_t cached_block = ~uint64_t{0};
  Philox4 r{};
  for (int64_t i = begin; i < end; ++i) {
    const uint64_t g = mask_index(i, layout) + offset;
    if (g / 4 != cached_block) {
      cached_block = g / 4;
      r = dropout_block(cached_block, k0, k1);
    }
    y[i] = dropout_element<Storage>(x[i], dropout_keep(philox_word(r, static_cast<int>(g % 4)), drop_threshold),
                                    scale);
  }
}

struct DropoutArgs {
  const void* x;
  void* y;
  int64_t groups;
  int64_t per_group;
  const uint32_t* keys;
  const uint32_t* offsets;  // (lo32, hi32) per group
  const MaskLayout* layout;  // null: contiguous
  uint32_t drop_threshold;
  float scale;
};

// Work item w covers elements [w * kItem, (w + 1) * kItem) of the flattened (group, element)
// space. An element's bits depend only on its own global index, so how the items are spread over
// threads cannot change any result.
constexpr int64_t kItem = int64_t{1} << 16;

template <typename Storage>
void DropoutItems(const DropoutArgs& a, int64_t first_item, int64_t last_item) {
  using Bits = typename Storage::Bits;
  const Bits* src = static_cast<const Bits*>(a.x);
  Bits* dst = static_cast<Bits*>(a.y);
  const int64_t total = a.groups * a.per_group;
  for (int64_t item = first_item; item < last_item; ++item) {
    int64_t i = item * kItem;
    const int64_t stop = std::min(total, i + kItem);
    while (i < stop) {  // an item may straddle groups
      const int64_t g = i / a.per_group;
      const int64_t begin = i - g * a.per_group;
      const int64_t end = std::min(a.per_group, begin + (stop - i));
      const uint32_t k0 = a.keys[2 * g], k1 = a.keys[2 * g + 1];
      const uint64_t offset =
          static_cast<uint64_t>(a.offsets[2 * g]) | (static_cast<uint64_t>(a.offsets[2 * g + 1]) << 32);
      const Bits* gx = src + g * a.per_group;
      Bits* gy = dst + g * a.per_group;
      if (a.layout) {
        DropoutRangeStrided<Storage>(gx, gy, begin, end, *a.layout, offset, k0, k1, a.drop_threshold, a.scale);
      } else {
        DropoutRange<Storage>(gx, gy, begin, end, offset, k0, k1, a.drop_threshold, a.scale);
      }
      i += end - begin;
    }
  }
}

template <typename Storage>
void DropoutAll(const DropoutArgs& a, ffi::ThreadPool& pool) {
  const int64_t items = (a.groups * a.per_group + kItem - 1) / kItem;
  // The caller is one of the workers (as the GEMM counts them): as many as the pool has threads.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(items, pool.num_threads()));
  parallel_for(pool, items, workers, [&a](int64_t item) { DropoutItems<Storage>(a, item, item + 1); });
}

ffi::Error DropoutCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U32> keys,
                      ffi::Buffer<ffi::U32> offsets, ffi::Result<ffi::AnyBuffer> y, uint32_t drop_threshold,
                      float scale, ffi::Span<const int64_t> mask_strides) {
  DropoutShape shape;
  if (auto err = check_dropout_args(x, keys, offsets, mask_strides, shape); !err.success()) return err;
  if (shape.n == 0) return ffi::Error::Success();
  const DropoutArgs args{x.untyped_data(),
                         y->untyped_data(),
                         shape.groups,
                         shape.per_group,
                         keys.typed_data(),
                         offsets.typed_data(),
                         mask_strides.size() == 0 ? nullptr : &shape.layout,
                         drop_threshold,
                         scale};
  IeeeSubnormalsScope ieee;  // parallel_for gives its tasks the caller's floating-point mode
  JAXDET_DISPATCH_FLOAT(x.element_type(), "jaxdet_dropout", "x", DropoutAll<S>(args, pool));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_philox_cpu, PhiloxCpu, bind_philox(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_dropout_cpu, DropoutCpu,
                              bind_dropout(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>()));

}  // namespace jaxdet
