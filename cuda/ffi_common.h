// Helpers shared by the FFI handlers of every primitive (CPU and CUDA).
#pragma once

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jaxdet {

namespace ffi = xla::ffi;

// Keys come as uint32[..., 2]: one Philox key per group of the data operand. The data operand's
// leading dimensions are the group dimensions, so each group is a contiguous slice of
// element_count / num_groups elements.
inline int64_t key_group_count(const ffi::Buffer<ffi::U32>& keys) {
  return static_cast<int64_t>(keys.element_count() / 2);
}

inline ffi::Error check_key_groups(int64_t data_count, int64_t groups, const char* op) {
  if (groups <= 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": keys must be uint32[..., 2] with at least one key");
  }
  if (data_count % groups != 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the data size is not a multiple of the key count");
  }
  return ffi::Error::Success();
}

}  // namespace jaxdet
