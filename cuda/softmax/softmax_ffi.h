// Argument checks and FFI signatures shared by the CPU and CUDA handlers of softmax, log_softmax
// and cross-entropy.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_common.h"
#include "softmax/softmax_math.h"  // stat_width

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

// The backward call: x and g are [R, n] of one dtype, and stats (checked when R * n > 0) is the
// forward's.
inline ffi::Error check_bwd_call(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::F32>& stats,
                                 const ffi::AnyBuffer& g, int64_t& rows, int64_t& n, const char* op) {
  if (auto err = rows_of(x, rows, n, op); !err.success()) return err;
  if (g.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(std::string(op) + ": g must have x's dtype");
  if (rows == 0 || n == 0) return ffi::Error::Success();
  return stats_fit(stats, rows, stat_width(n), op);
}

// The cross-entropy forward call: x is [R, n] logits with one int32 label per row, and a row
// needs at least one class (its loss would be undefined).
inline ffi::Error check_xent_fwd_call(const ffi::AnyBuffer& x, const ffi::Buffer<ffi::S32>& labels, int64_t& rows,
                                      int64_t& n, const char* op) {
  if (auto err = rows_of(x, rows, n, op); !err.success()) return err;
  if (static_cast<int64_t>(labels.element_count()) != rows) {
    return ffi::Error::InvalidArgument(std::string(op) + ": labels must be int32[R]");
  }
  if (rows > 0 && n == 0)
    return ffi::Error::InvalidArgument(std::string(op) + ": logits must have at least one class");
  return ffi::Error::Success();
}

// The FFI signatures: each binds the operands, results and attributes that follow the platform's
// context (none on the CPU, the stream on CUDA), so both backends take the one call that
// jaxdet/softmax.py makes. The workspaces are used on CUDA only (rows of more than one segment).

// jaxdet_softmax_fwd: x -> (y, stats, workspace); attribute mode.
template <typename Binding>
auto bind_softmax_fwd(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int32_t>("mode");
}

// jaxdet_softmax_bwd: (x, stats, g) -> (dx, workspace); attribute mode.
template <typename Binding>
auto bind_softmax_bwd(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int32_t>("mode");
}

// jaxdet_xent_fwd: (x, labels) -> (out, stats, workspace); attribute log_prob.
template <typename Binding>
auto bind_xent_fwd(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<bool>("log_prob");
}

// jaxdet_xent_bwd: (x, labels, stats, g) -> dx.
template <typename Binding>
auto bind_xent_bwd(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>();
}

// jaxdet_det_math: x -> y; attribute op.
template <typename Binding>
auto bind_det_math(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<int32_t>("op");
}

}  // namespace softmax
}  // namespace jaxdet
