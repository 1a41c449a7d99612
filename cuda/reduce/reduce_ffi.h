// The FFI call of jaxdet_reduce, shared by the CPU and CUDA handlers: x [A, K, B] -> out [A, B]
// (float32, or x's dtype), attribute `chunk` (the chunk size C). The rule (docs/reduce.md): the K
// reduced elements of an output are cut into chunks of C by absolute index; each chunk folds its
// elements in ascending k in float32 from +0 (one IEEE add each, round to nearest even); the chunk
// partials are combined by the canonical tree (common/det_math.h tree_fold); the root is cast once.
// The CUDA handler has one more result, a uint8 workspace of workspace_bytes(dims) bytes (the
// chunk partials when there are several chunks).
#pragma once

#include <cstdint>
#include <string>

#include "common/ffi_common.h"

namespace jaxdet {
namespace reduce {

struct Dims {
  int64_t A = 0, K = 0, B = 0;  // x [A, K, B]
  int64_t chunk = 0;            // C
  int64_t chunks = 0;           // ceil(K / C)
  int64_t outputs() const { return A * B; }
};

// Bytes of the float32 chunk partials [chunks, A, B] when there are several chunks, else 0 (one
// chunk's partial is the root: the kernels write the result directly). jaxdet/_src/reduce/reduce.py
// computes the same size.
inline int64_t workspace_bytes(const Dims& d) {
  return d.chunks > 1 ? d.chunks * d.outputs() * static_cast<int64_t>(sizeof(float)) : 0;
}

inline ffi::Error dims_of(const ffi::AnyBuffer& x, const ffi::AnyBuffer& out, int64_t chunk, Dims& d,
                          const char* op) {
  const auto xd = x.dimensions();
  const auto od = out.dimensions();
  if (xd.size() != 3) return ffi::Error::InvalidArgument(std::string(op) + ": x must be [A, K, B]");
  if (od.size() != 2 || od[0] != xd[0] || od[1] != xd[2]) {
    return ffi::Error::InvalidArgument(std::string(op) + ": out must be [A, B] for x [A, K, B]");
  }
  if (chunk <= 0) return ffi::Error::InvalidArgument(std::string(op) + ": chunk must be > 0");
  if (out.element_type() != ffi::F32 && out.element_type() != x.element_type()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": out must be float32 or x's dtype");
  }
  d.A = xd[0];
  d.K = xd[1];
  d.B = xd[2];
  d.chunk = chunk;
  d.chunks = (d.K + chunk - 1) / chunk;
  return ffi::Error::Success();
}

// Calls fn(S{}, O{}) with S the storage tag of x's dtype and O that of out's (float32, or S), and
// returns its error; any other x dtype is an InvalidArgument naming `op`.
template <typename Fn>
ffi::Error dispatch(ffi::DataType x_type, ffi::DataType out_type, const char* op, Fn&& fn) {
  const bool f32_out = out_type == ffi::F32;
  switch (x_type) {
    case ffi::F32: return fn(F32Storage{}, F32Storage{});
    case ffi::BF16: return f32_out ? fn(BF16Storage{}, F32Storage{}) : fn(BF16Storage{}, BF16Storage{});
    case ffi::F16: return f32_out ? fn(F16Storage{}, F32Storage{}) : fn(F16Storage{}, F16Storage{});
    default: return ffi::Error::InvalidArgument(std::string(op) + ": x must be float32, bfloat16 or float16");
  }
}

}  // namespace reduce
}  // namespace jaxdet
