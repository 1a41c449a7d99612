// Argument checks and the FFI signature shared by the CPU and CUDA handlers of jaxdet_segment_sum.
//
//   jaxdet_segment_sum  (data [L, T, D], sorted_ids s32[L, T], order s32[L, T]) -> out [L, V, D]
//                       (CUDA: and a workspace u8[>= 4 L (V + 1)]) attr chunk_tokens
//
// sorted_ids[l] are the ids of batch element l sorted ascending and order[l] the token indices t
// in [0, T) in that order, ascending t among equal ids (a stable sort: jaxdet/_src/embed/embed.py
// runs it in XLA). Segment v owns the tokens order[l][lower_bound(v) : lower_bound(v + 1)]
// (lower_bound(v): the number of sorted ids below v), so tokens whose id is outside [0, V) are in
// no segment. data is float32, bfloat16 or float16; out is data's dtype or float32.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_common.h"
#include "common/philox.h"  // JAXDET_HD
#include "embed/embed_math.h"  // kMaxChunkBits

namespace jaxdet {
namespace embed {

struct SegmentSumShape {
  int64_t L, T, D, V;
  int64_t chunk_tokens;
};

inline ffi::Error check_segment_sum_args(const ffi::AnyBuffer& data, const ffi::Buffer<ffi::S32>& sorted_ids,
                                         const ffi::Buffer<ffi::S32>& order, const ffi::AnyBuffer& out,
                                         int64_t chunk_tokens, SegmentSumShape& s) {
  const auto dd = data.dimensions(), sd = sorted_ids.dimensions(), od = order.dimensions(), rd = out.dimensions();
  if (dd.size() != 3 || sd.size() != 2 || od.size() != 2 || rd.size() != 3) {
    return ffi::Error::InvalidArgument(
        "jaxdet_segment_sum: expects data [L, T, D], sorted_ids [L, T], order [L, T] and out [L, V, D]");
  }
  s = SegmentSumShape{dd[0], dd[1], dd[2], rd[1], chunk_tokens};
  if (sd[0] != s.L || sd[1] != s.T || od[0] != s.L || od[1] != s.T || rd[0] != s.L || rd[2] != s.D) {
    return ffi::Error::InvalidArgument("jaxdet_segment_sum: mismatched shapes of data, sorted_ids, order and out");
  }
  if (s.V >= INT32_MAX) return ffi::Error::InvalidArgument("jaxdet_segment_sum: V must be < 2^31 - 1");
  if (chunk_tokens <= 0 || s.T > INT32_MAX ||
      (s.T > 0 && (s.T - 1) / chunk_tokens >= (int64_t{1} << kMaxChunkBits))) {
    return ffi::Error::InvalidArgument(
        "jaxdet_segment_sum: chunk_tokens must be positive, T < 2^31 and the chunks fewer than 2^19");
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

// The number of the n ascending values of `sorted` below v (std::lower_bound's index).
JAXDET_HD int64_t count_below(const int32_t* sorted, int64_t n, int64_t v) {
  int64_t lo = 0;
  while (n > 0) {
    const int64_t half = n / 2;
    if (sorted[lo + half] < v) {
      lo += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return lo;
}

// The FFI signature: the operands after the platform's context (the thread pool on the CPU, the
// stream on CUDA), then the result; CUDA binds its workspace result before the attribute.
template <typename Binding>
auto bind_segment_sum_buffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>();
}

template <typename Binding>
auto bind_segment_sum_attrs(Binding&& binding) {
  return std::forward<Binding>(binding).template Attr<int64_t>("chunk_tokens");
}

}  // namespace embed
}  // namespace jaxdet
