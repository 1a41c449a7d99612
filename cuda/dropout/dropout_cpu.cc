// CPU targets of the Philox block function and of dropout. The math is the shared header's, so
// these produce the same bits as the CUDA kernels.
#include <cstdint>
#include <cstring>

#include "common/ffi_common.h"
#include "common/philox.h"

namespace jaxdet {
namespace {

ffi::Error PhiloxCpu(ffi::Buffer<ffi::U32> counters, ffi::Buffer<ffi::U32> keys,
                     ffi::ResultBuffer<ffi::U32> out) {
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

// One group: elements x[0, n) have global indices offset .. offset + n - 1. Whole Philox blocks are
// walked so each block is hashed once and all 4 of its words are used.
template <typename Storage>
void DropoutGroup(const typename Storage::Bits* x, typename Storage::Bits* y, int64_t n, uint64_t offset,
                  uint32_t k0, uint32_t k1, uint32_t drop_threshold, float scale) {
  int64_t i = 0;
  uint64_t block = offset / 4;
  int lane = static_cast<int>(offset % 4);
  while (i < n) {
    const Philox4 r = dropout_block(block, k0, k1);
    for (; lane < 4 && i < n; ++lane, ++i) {
      y[i] = dropout_element<Storage>(x[i], dropout_keep(r.v[lane], drop_threshold), scale);
    }
    lane = 0;
    ++block;
  }
}

// broadcast_dims: each element finds its mask index through the layout; consecutive elements
// usually share a Philox block, so the last block is kept.
template <typename Storage>
void DropoutGroupStrided(const typename Storage::Bits* x, typename Storage::Bits* y, int64_t n,
                         const MaskLayout& layout, uint64_t offset, uint32_t k0, uint32_t k1,
                         uint32_t drop_threshold, float scale) {
  uint64_t cached_block = ~uint64_t{0};
  Philox4 r{};
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t g = mask_index(i, layout) + offset;
    if (g / 4 != cached_block) {
      cached_block = g / 4;
      r = dropout_block(cached_block, k0, k1);
    }
    y[i] = dropout_element<Storage>(x[i], dropout_keep(philox_word(r, static_cast<int>(g % 4)), drop_threshold),
                                    scale);
  }
}

template <typename Storage>
void DropoutAll(const void* x, void* y, int64_t groups, int64_t per_group, const uint32_t* key,
                const MaskLayout* layout, uint64_t offset, uint32_t drop_threshold, float scale) {
  using Bits = typename Storage::Bits;
  const Bits* src = static_cast<const Bits*>(x);
  Bits* dst = static_cast<Bits*>(y);
  for (int64_t g = 0; g < groups; ++g) {
    if (layout) {
      DropoutGroupStrided<Storage>(src + g * per_group, dst + g * per_group, per_group, *layout, offset,
                                   key[2 * g], key[2 * g + 1], drop_threshold, scale);
    } else {
      DropoutGroup<Storage>(src + g * per_group, dst + g * per_group, per_group, offset, key[2 * g],
                            key[2 * g + 1], drop_threshold, scale);
    }
  }
}

ffi::Error DropoutCpu(ffi::AnyBuffer x, ffi::Buffer<ffi::U32> keys, ffi::Result<ffi::AnyBuffer> y,
                      uint32_t drop_threshold, int64_t offset, float scale,
                      ffi::Span<const int64_t> mask_strides) {
  const int64_t n = static_cast<int64_t>(x.element_count());
  const int64_t groups = key_group_count(keys);
  if (auto err = check_key_groups(n, groups, "jaxdet_dropout"); !err.success()) return err;
  if (offset < 0) return ffi::Error::InvalidArgument("jaxdet_dropout: offset must be >= 0");
  MaskLayout layout;
  if (auto err = make_mask_layout(x.dimensions(), mask_strides, layout); !err.success()) return err;
  const MaskLayout* strided = (mask_strides.size() == 0) ? nullptr : &layout;
  const int64_t per_group = n / groups;
  const uint32_t* key = keys.typed_data();
  IeeeSubnormalsScope ieee;
  switch (x.element_type()) {
    case ffi::F32:
      DropoutAll<F32Storage>(x.untyped_data(), y->untyped_data(), groups, per_group, key, strided, offset,
                             drop_threshold, scale);
      break;
    case ffi::BF16:
      DropoutAll<BF16Storage>(x.untyped_data(), y->untyped_data(), groups, per_group, key, strided, offset,
                              drop_threshold, scale);
      break;
    case ffi::F16:
      DropoutAll<F16Storage>(x.untyped_data(), y->untyped_data(), groups, per_group, key, strided, offset,
                             drop_threshold, scale);
      break;
    default:
      return ffi::Error::InvalidArgument("jaxdet_dropout: x must be float32, bfloat16 or float16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_philox_cpu, PhiloxCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::U32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_dropout_cpu, DropoutCpu,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<uint32_t>("drop_threshold")
                                  .Attr<int64_t>("offset")
                                  .Attr<float>("scale")
                                  .Attr<ffi::Span<const int64_t>>("mask_strides"));

}  // namespace jaxdet
