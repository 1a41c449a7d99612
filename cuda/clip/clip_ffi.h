// Decoding of the clipping FFI calls, shared by the CPU and CUDA handlers (same operands, results
// and checks on both backends).
//
//   fused     jaxdet_clip_global_norm  (max_norm, *leaves) -> (norm, scratch, *clipped aliased)
//             jaxdet_global_norm       (*leaves) -> (norm, scratch)
//   staged    jaxdet_clip_partials     (*leaves) -> (slots f32[..., C], [*leaves aliased]) (batch = the
//                                      product of the slots' leading dims; the optional pass-through
//                                      results let the apply stage be the leaves' only in-place user)
//             jaxdet_clip_finalize     (slots, max_norm f32[1 or batch]) -> (norm f32[batch],
//                                      ctrl u32[batch, 2])                        attr nonfinite
//             jaxdet_clip_apply        (ctrl, *leaves) -> (*clipped aliased)
//
// In the staged calls every leaf holds `batch` examples one after the other (leading dims), and
// each example is clipped as if it were alone: example b of leaf i is elements
// [b * m_i, (b + 1) * m_i) with m_i = size_i / batch; its C = sum_i ceil(m_i / 4096) chunk slots
// are slots[b * C, (b + 1) * C) (leaf by leaf), and its decision is ctrl[b] = (scale bits, mode).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "clip_math.h"
#include "common/ffi_common.h"

namespace jaxdet {
namespace clip {

enum DtypeCode : uint8_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

struct Leaf {
  DtypeCode dtype;
  const void* in;
  void* out;
  int64_t size;  // elements of one example (the whole leaf when batch == 1)
};

inline int64_t bytes_per_element(DtypeCode code) { return code == kF32 ? 4 : 2; }

inline ffi::DataType data_type(DtypeCode code) {
  return code == kF32 ? ffi::F32 : code == kBF16 ? ffi::BF16 : ffi::F16;
}

inline int64_t chunk_count(int64_t size) { return (size + kChunk - 1) / kChunk; }

inline ffi::Error collect_leaves(const ffi::RemainingArgs& args, size_t first, std::vector<Leaf>& leaves,
                                 const char* op, int64_t batch = 1) {
  for (size_t i = first; i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    DtypeCode code;
    switch (buf->element_type()) {
      case ffi::F32: code = kF32; break;
      case ffi::BF16: code = kBF16; break;
      case ffi::F16: code = kF16; break;
      default:
        return ffi::Error::InvalidArgument(std::string(op) + ": leaf " + std::to_string(i - first) +
                                           " must be float32, bfloat16 or float16");
    }
    const int64_t count = static_cast<int64_t>(buf->element_count());
    if (batch < 0 || (batch == 0 ? count != 0 : count % batch != 0)) {
      return ffi::Error::InvalidArgument(std::string(op) + ": leaf " + std::to_string(i - first) +
                                         " does not hold a whole number of the " + std::to_string(batch) +
                                         " examples");
    }
    leaves.push_back(Leaf{code, buf->untyped_data(), nullptr, batch == 0 ? 0 : count / batch});
  }
  return ffi::Error::Success();
}

// The example count of a slots buffer f32[..., C]: the product of its leading dims.
template <typename Dims>
inline int64_t slot_batch(const Dims& dims) {
  int64_t batch = 1;
  for (size_t d = 0; d + 1 < dims.size(); ++d) batch *= dims[d];
  return batch;
}

// Chunk slots of one example: chunks never span leaves, empty leaves have none.
inline int64_t example_chunks(const std::vector<Leaf>& leaves) {
  int64_t chunks = 0;
  for (const Leaf& leaf : leaves) chunks += chunk_count(leaf.size);
  return chunks;
}

// Pairs every leaf with its (aliased) result buffer.
inline ffi::Error attach_results(const ffi::RemainingRets& rets, size_t first, std::vector<Leaf>& leaves,
                                 int64_t batch, const char* op) {
  if (rets.size() != first + leaves.size()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": one result per leaf expected");
  }
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto out = rets.get<ffi::AnyBuffer>(first + i);
    if (out.has_error()) return out.error();
    if ((*out)->element_type() != data_type(leaves[i].dtype) ||
        static_cast<int64_t>((*out)->element_count()) != leaves[i].size * batch) {
      return ffi::Error::InvalidArgument(std::string(op) + ": result " + std::to_string(i) +
                                         " does not match its leaf");
    }
    leaves[i].out = (*out)->untyped_data();
  }
  return ffi::Error::Success();
}

inline ffi::Error check_policy(int32_t nonfinite, const char* op) {
  if (nonfinite != kPropagate && nonfinite != kSkip) {
    return ffi::Error::InvalidArgument(std::string(op) + ": unknown nonfinite policy");
  }
  return ffi::Error::Success();
}

// The finalize call: `batch` (norm's size) examples of `chunks` slots each, one max_norm or one per
// example.
inline ffi::Error check_finalize_call(const ffi::Buffer<ffi::F32>& slots, const ffi::Buffer<ffi::F32>& max_norm,
                                      const ffi::Buffer<ffi::F32>& norm, const ffi::Buffer<ffi::U32>& ctrl,
                                      int32_t nonfinite, int64_t& batch, int64_t& chunks, const char* op) {
  if (auto err = check_policy(nonfinite, op); !err.success()) return err;
  batch = static_cast<int64_t>(norm.element_count());
  const int64_t slot_count = static_cast<int64_t>(slots.element_count());
  const int64_t max_norm_count = static_cast<int64_t>(max_norm.element_count());
  if (static_cast<int64_t>(ctrl.element_count()) != 2 * batch)
    return ffi::Error::InvalidArgument(std::string(op) + ": ctrl must be uint32[batch, 2]");
  if (max_norm_count != 1 && max_norm_count != batch) {
    return ffi::Error::InvalidArgument(std::string(op) + ": max_norm must be a scalar or one value per example");
  }
  if (batch == 0 ? slot_count != 0 : slot_count % batch != 0) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": the slot count is not a multiple of the example count");
  }
  chunks = batch == 0 ? 0 : slot_count / batch;
  return ffi::Error::Success();
}

// The clip call: checks max_norm and the policy, collects the leaves and pairs each with its
// (aliased) result buffer.
inline ffi::Error decode_clip_call(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets,
                                   int32_t nonfinite, const float*& max_norm, std::vector<Leaf>& leaves,
                                   const char* op) {
  if (args.size() < 1) return ffi::Error::InvalidArgument(std::string(op) + ": missing max_norm");
  auto max_norm_buf = args.get<ffi::Buffer<ffi::F32>>(0);
  if (max_norm_buf.has_error()) return max_norm_buf.error();
  if (max_norm_buf->element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": max_norm must be a float32 scalar");
  }
  max_norm = max_norm_buf->typed_data();
  if (auto err = check_policy(nonfinite, op); !err.success()) return err;
  if (auto err = collect_leaves(args, 1, leaves, op); !err.success()) return err;
  return attach_results(rets, 0, leaves, 1, op);
}

// The FFI signatures, shared by the CPU and CUDA handlers: each binds the operands, results and
// attributes that follow the platform's context (none on the CPU, the stream on CUDA), so both
// backends take the one call that jaxdet/clip.py makes (the calls are listed at the top).

template <typename Binding>
auto bind_global_norm(Binding&& binding) {
  return std::forward<Binding>(binding)
      .RemainingArgs()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

template <typename Binding>
auto bind_clip_global_norm(Binding&& binding) {
  return bind_global_norm(std::forward<Binding>(binding)).RemainingRets().template Attr<int32_t>("nonfinite");
}

template <typename Binding>
auto bind_partials(Binding&& binding) {
  return std::forward<Binding>(binding).RemainingArgs().template Ret<ffi::Buffer<ffi::F32>>().RemainingRets();
}

template <typename Binding>
auto bind_finalize(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::U32>>()
      .template Attr<int32_t>("nonfinite");
}

template <typename Binding>
auto bind_apply(Binding&& binding) {
  return std::forward<Binding>(binding).template Arg<ffi::Buffer<ffi::U32>>().RemainingArgs().RemainingRets();
}

}  // namespace clip
}  // namespace jaxdet
