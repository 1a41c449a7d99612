// Argument checks and FFI signatures shared by the CPU and CUDA handlers of jaxdet_dropout.
#pragma once

#include <cstdint>
#include <utility>

#include "common/ffi_common.h"
#include "common/philox.h"  // MaskLayout

namespace jaxdet {

// A checked jaxdet_dropout call: x of n elements in `groups` groups of per_group, one key and one
// (lo32, hi32) offset pair per group, and the broadcast layout of mask_strides (see
// make_mask_layout).
struct DropoutShape {
  int64_t n;
  int64_t groups;
  int64_t per_group;
  MaskLayout layout;
};

inline ffi::Error check_dropout_args(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::U32>& keys,
                                     const ffi::Buffer<ffi::U32>& offsets, ffi::Span<const int64_t> mask_strides,
                                     DropoutShape& shape) {
  shape.n = static_cast<int64_t>(x.element_count());
  shape.groups = key_group_count(keys);
  if (auto err = check_key_groups(shape.n, shape.groups, "jaxdet_dropout"); !err.success()) return err;
  shape.per_group = shape.n / shape.groups;
  if (static_cast<int64_t>(offsets.element_count()) != 2 * shape.groups) {
    return ffi::Error::InvalidArgument(
        "jaxdet_dropout: offsets must be uint32[..., 2], one (lo32, hi32) pair per key");
  }
  return make_mask_layout(x.dimensions(), mask_strides, shape.layout);
}

// The FFI signatures, shared by the CPU and CUDA handlers: each binds the operands, results and
// attributes that follow the platform's context (the thread pool on the CPU, the stream on CUDA),
// so both backends take the one call that jaxdet/dropout.py makes.

// jaxdet_philox4x32_10: (counters, keys) -> out.
template <typename Binding>
auto bind_philox(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template Ret<ffi::Buffer<ffi::U32>>();
}

// jaxdet_dropout: (x, keys, offsets) -> y; attributes drop_threshold, scale, mask_strides.
template <typename Binding>
auto bind_dropout(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template Arg<ffi::Buffer<ffi::U32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<uint32_t>("drop_threshold")
      .template Attr<float>("scale")
      .template Attr<ffi::Span<const int64_t>>("mask_strides");
}

}  // namespace jaxdet
