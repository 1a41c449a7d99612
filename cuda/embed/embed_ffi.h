// Argument checks and the FFI signature shared by the CPU and CUDA handlers of jaxdet_segment_sum.
//
//   jaxdet_segment_sum  (data [L, T, D], order s32[L, T], offsets s32[L, V + 1]) -> out [L, V, D]
//                       attr chunk_tokens
//
// order[l] lists the token indices t in [0, T) sorted by (segment id, t), and segment v of batch l
// owns order[l][offsets[l][v] : offsets[l][v + 1]] (tokens whose id is outside [0, V) are in
// neither range). jaxdet/_src/embed/embed.py computes both with a sort in XLA. data is float32,
// bfloat16 or float16; out is data's dtype or float32.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_common.h"

namespace jaxdet {
namespace embed {

struct SegmentSumShape {
  int64_t L, T, D, V;
  int64_t chunk_tokens;
};

inline ffi::Error check_segment_sum_args(const ffi::AnyBuffer& data, const ffi::Buffer<ffi::S32>& order,
                                         const ffi::Buffer<ffi::S32>& offsets, const ffi::AnyBuffer& out,
                                         int64_t chunk_tokens, SegmentSumShape& s) {
  const auto dd = data.dimensions(), od = order.dimensions(), fd = offsets.dimensions(), rd = out.dimensions();
  if (dd.size() != 3 || od.size() != 2 || fd.size() != 2 || rd.size() != 3) {
    return ffi::Error::InvalidArgument(
        "jaxdet_segment_sum: expects data [L, T, D], order [L, T], offsets [L, V + 1] and out [L, V, D]");
  }
  s = SegmentSumShape{dd[0], dd[1], dd[2], rd[1], chunk_tokens};
  if (od[0] != s.L || od[1] != s.T || fd[0] != s.L || fd[1] != s.V + 1 || rd[0] != s.L || rd[2] != s.D) {
    return ffi::Error::InvalidArgument("jaxdet_segment_sum: mismatched shapes of data, order, offsets and out");
  }
  if (chunk_tokens <= 0 || s.T > INT32_MAX) {
    return ffi::Error::InvalidArgument("jaxdet_segment_sum: chunk_tokens must be positive and T < 2^31");
  }
  const auto in_type = data.element_type(), out_type = out.element_type();
  if (in_type != ffi::F32 && in_type != ffi::BF16 && in_type != ffi::F16) {
    return ffi::Error::InvalidArgument("jaxdet_segment_sum: data must be float32, bfloat16 or float16");
  }
  if (out_type != in_type && out_type != ffi::F32) {
    return ffi::Error::InvalidArgument("jaxdet_segment_sum: out must have data's dtype or float32");
  }
  return ffi::Error::Success();
}

// Runs CALL with `In` and `Out` the storage tags of data's and out's dtypes (checked above).
#define JAXDET_DISPATCH_SEGMENT_SUM(in_type, out_type, CALL) \
  do {                                                       \
    const bool out_f32 = (out_type) == ::xla::ffi::F32;      \
    switch (in_type) {                                       \
      case ::xla::ffi::BF16:                                 \
        if (out_f32) {                                       \
          using In = ::jaxdet::BF16Storage;                  \
          using Out = ::jaxdet::F32Storage;                  \
          CALL;                                              \
        } else {                                             \
          using In = ::jaxdet::BF16Storage;                  \
          using Out = ::jaxdet::BF16Storage;                 \
          CALL;                                              \
        }                                                    \
        break;                                               \
      case ::xla::ffi::F16:                                  \
        if (out_f32) {                                       \
          using In = ::jaxdet::F16Storage;                   \
          using Out = ::jaxdet::F32Storage;                  \
          CALL;                                              \
        } else {                                             \
          using In = ::jaxdet::F16Storage;                   \
          using Out = ::jaxdet::F16Storage;                  \
          CALL;                                              \
        }                                                    \
        break;                                               \
      default: {                                             \
        using In = ::jaxdet::F32Storage;                     \
        using Out = ::jaxdet::F32Storage;                    \
        CALL;                                                \
        break;                                               \
      }                                                      \
    }                                                        \
  } while (0)

// The FFI signature (the platform's context first: the thread pool on the CPU, the stream on CUDA).
template <typename Binding>
auto bind_segment_sum(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("chunk_tokens");
}

}  // namespace embed
}  // namespace jaxdet
