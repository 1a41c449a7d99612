// Argument checks shared by the CPU and CUDA handlers of jaxdet_dropout.
#pragma once

#include <cstdint>

#include "common/ffi_common.h"
#include "common/philox.h"  // MaskLayout

namespace jaxdet {

// x of n elements in `groups` groups, one key and one (lo32, hi32) offset pair per group, and the
// broadcast layout of mask_strides (see make_mask_layout).
inline ffi::Error check_dropout_args(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::U32>& keys,
                                     const ffi::Buffer<ffi::U32>& offsets, ffi::Span<const int64_t> mask_strides,
                                     int64_t& n, int64_t& groups, MaskLayout& layout) {
  n = static_cast<int64_t>(x.element_count());
  groups = key_group_count(keys);
  if (auto err = check_key_groups(n, groups, "jaxdet_dropout"); !err.success()) return err;
  if (static_cast<int64_t>(offsets.element_count()) != 2 * groups) {
    return ffi::Error::InvalidArgument(
        "jaxdet_dropout: offsets must be uint32[..., 2], one (lo32, hi32) pair per key");
  }
  return make_mask_layout(x.dimensions(), mask_strides, layout);
}

}  // namespace jaxdet
