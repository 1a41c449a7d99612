// Helpers shared by the FFI handlers of every primitive (CPU and CUDA).
#pragma once

#include <cstdint>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "common/philox.h"  // the storage tags F32Storage, BF16Storage, F16Storage
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

// The last mask_strides.size() dimensions of x are the per-key dimensions of a broadcast_dims
// dropout (see MaskLayout in philox.h). An empty span means "contiguous, no broadcast".
template <typename Dims, typename Layout>
inline ffi::Error make_mask_layout(Dims dims, ffi::Span<const int64_t> strides, Layout& layout) {
  layout.rank = static_cast<int>(strides.size());
  if ((strides.size() == 0)) return ffi::Error::Success();
  if (strides.size() > sizeof(layout.dims) / sizeof(layout.dims[0]) || strides.size() > dims.size()) {
    return ffi::Error::InvalidArgument("jaxdet_dropout: mask_strides has more entries than x has dimensions");
  }
  const size_t first = dims.size() - strides.size();
  for (size_t d = 0; d < strides.size(); ++d) {
    layout.dims[d] = dims[first + d];
    layout.strides[d] = strides[d];
    if (layout.dims[d] <= 0) layout.dims[d] = 1;
  }
  return ffi::Error::Success();
}

// Runs CALL with `S` the storage tag of a float dtype (float32, bfloat16 or float16); any other
// dtype returns InvalidArgument "<op>: <operand> must be float32, bfloat16 or float16" from the
// enclosing handler. `operand` is a string literal naming the argument (Python tests match it).
#define JAXDET_DISPATCH_FLOAT(dtype, op, operand, CALL)                                                     \
  switch (dtype) {                                                                                          \
    case ::xla::ffi::F32: {                                                                                 \
      using S = ::jaxdet::F32Storage;                                                                       \
      CALL;                                                                                                 \
      break;                                                                                                \
    }                                                                                                       \
    case ::xla::ffi::BF16: {                                                                                \
      using S = ::jaxdet::BF16Storage;                                                                      \
      CALL;                                                                                                 \
      break;                                                                                                \
    }                                                                                                       \
    case ::xla::ffi::F16: {                                                                                 \
      using S = ::jaxdet::F16Storage;                                                                       \
      CALL;                                                                                                 \
      break;                                                                                                \
    }                                                                                                       \
    default:                                                                                                \
      return ::xla::ffi::Error::InvalidArgument(std::string(op) + ": " operand                              \
                                                                  " must be float32, bfloat16 or float16"); \
  }

// XLA's CPU runtime calls handlers with flush-to-zero and denormals-are-zero set, while the CUDA
// kernels keep IEEE subnormals. CPU handlers whose results must equal the GPU's bit for bit do
// their float arithmetic inside this scope, which restores IEEE subnormal behaviour and puts the
// caller's mode back on exit.
class IeeeSubnormalsScope {
 public:
  IeeeSubnormalsScope() {
#if defined(__x86_64__) || defined(_M_X64)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~(kFlushToZero | kDenormalsAreZero));
#elif defined(__aarch64__)
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t ieee = saved_ & ~(uint64_t{1} << 24);  // FZ
    __asm__ __volatile__("msr fpcr, %0" : : "r"(ieee));
#endif
  }
  ~IeeeSubnormalsScope() {
#if defined(__x86_64__) || defined(_M_X64)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    __asm__ __volatile__("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  IeeeSubnormalsScope(const IeeeSubnormalsScope&) = delete;
  IeeeSubnormalsScope& operator=(const IeeeSubnormalsScope&) = delete;

 private:
#if defined(__x86_64__) || defined(_M_X64)
  static constexpr unsigned kFlushToZero = 0x8000u;
  static constexpr unsigned kDenormalsAreZero = 0x0040u;
  unsigned saved_ = 0;
#else
  uint64_t saved_ = 0;
#endif
};

}  // namespace jaxdet
