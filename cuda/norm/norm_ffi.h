// The FFI signatures of the RMSNorm / LayerNorm targets, shared by the CPU and CUDA handlers: each
// binds the operands, results and attributes that follow the platform's context (none on the CPU,
// the stream on CUDA), so both backends take the one call that jaxdet/norm.py makes.
#pragma once

#include <utility>

#include "common/ffi_common.h"

namespace jaxdet {
namespace norm {

// jaxdet_norm_fwd: (x, w, b) -> (y, stats f32[rows, 2]); attributes eps, center.
template <typename Binding>
auto bind_fwd(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Attr<float>("eps")
      .template Attr<bool>("center");
}

// jaxdet_norm_bwd: (x, w, stats, g) -> dx; attribute center.
template <typename Binding>
auto bind_bwd(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<bool>("center");
}

// jaxdet_norm_param_grad: (x, stats, g) -> (dw, db, and the workspaces ws_w, ws_b).
template <typename Binding>
auto bind_param_grad(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace norm
}  // namespace jaxdet
