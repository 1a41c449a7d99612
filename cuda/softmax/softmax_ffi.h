// Argument checks shared by the CPU and CUDA handlers of softmax, log_softmax and cross-entropy.
#pragma once

#include <cstdint>
#include <string>

#include "common/ffi_common.h"

namespace jaxdet {
namespace softmax {

// x is [R, n]: R independent rows of n elements.
inline ffi::Error rows_of(const ffi::AnyBuffer& x, int64_t& rows, int64_t& n, const char* op) {
  const auto d = x.dimensions();
  if (d.size() != 2) return ffi::Error::InvalidArgument(std::string(op) + ": x must be [R, n]");
  rows = d[0];
  n = d[1];
  return ffi::Error::Success();
}

// stats is float32 [R, stat_width(n)] (softmax_math.h), as the forward wrote it.
inline ffi::Error stats_fit(const ffi::Buffer<ffi::F32>& stats, int64_t rows, int64_t width, const char* op) {
  if (static_cast<int64_t>(stats.element_count()) != rows * width) {
    return ffi::Error::InvalidArgument(std::string(op) + ": stats must be float32[R, " + std::to_string(width) +
                                       "]");
  }
  return ffi::Error::Success();
}

}  // namespace softmax
}  // namespace jaxdet
