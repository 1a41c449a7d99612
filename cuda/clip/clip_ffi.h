// Decoding of the clipping FFI calls, shared by the CPU and CUDA handlers: both take the same
// operands (max_norm, then the leaves) and results (norm, scratch, then one result per leaf).
#pragma once

#include <cstdint>
#include <string>
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
  int64_t size;
};

inline ffi::DataType data_type(DtypeCode code) {
  return code == kF32 ? ffi::F32 : code == kBF16 ? ffi::BF16 : ffi::F16;
}

inline int64_t chunk_count(int64_t size) { return (size + kChunk - 1) / kChunk; }

inline ffi::Error collect_leaves(const ffi::RemainingArgs& args, size_t first, std::vector<Leaf>& leaves,
                                 const char* op) {
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
    leaves.push_back(Leaf{code, buf->untyped_data(), nullptr, static_cast<int64_t>(buf->element_count())});
  }
  return ffi::Error::Success();
}

// The clip call: checks max_norm and the policy, collects the leaves and pairs each with its
// (aliased) result buffer.
inline ffi::Error decode_clip_call(const ffi::RemainingArgs& args, const ffi::RemainingRets& rets, int32_t nonfinite,
                                   const float*& max_norm, std::vector<Leaf>& leaves, const char* op) {
  if (args.size() < 1) return ffi::Error::InvalidArgument(std::string(op) + ": missing max_norm");
  auto max_norm_buf = args.get<ffi::Buffer<ffi::F32>>(0);
  if (max_norm_buf.has_error()) return max_norm_buf.error();
  if (max_norm_buf->element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": max_norm must be a float32 scalar");
  }
  max_norm = max_norm_buf->typed_data();
  if (nonfinite != kPropagate && nonfinite != kSkip) {
    return ffi::Error::InvalidArgument(std::string(op) + ": unknown nonfinite policy");
  }
  if (auto err = collect_leaves(args, 1, leaves, op); !err.success()) return err;
  if (rets.size() != leaves.size()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": one result per leaf expected");
  }
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (out.has_error()) return out.error();
    if ((*out)->element_type() != data_type(leaves[i].dtype) ||
        static_cast<int64_t>((*out)->element_count()) != leaves[i].size) {
      return ffi::Error::InvalidArgument(std::string(op) + ": result " + std::to_string(i) +
                                         " does not match its leaf");
    }
    leaves[i].out = (*out)->untyped_data();
  }
  return ffi::Error::Success();
}

}  // namespace clip
}  // namespace jaxdet
