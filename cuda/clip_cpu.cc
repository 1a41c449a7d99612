// CPU targets of global-norm clipping: the canonical order of cuda/clip_math.h, walked with plain
// loops that mirror the CUDA kernels' lanes and trees exactly (same operations, same order), so the
// norm and every clipped element are bitwise equal to the GPU's.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "clip_math.h"
#include "ffi_common.h"

namespace jaxdet {
namespace {

using clip::kChunk;
using clip::kFinalLanes;
using clip::kLanes;
using clip::kSteps;
using clip::kVec;

// XLA's CPU runtime may run with flush-to-zero / denormals-are-zero set; the CUDA kernels keep
// IEEE subnormals, so this handler clears both for its duration and restores the caller's state.
class IeeeSubnormals {
 public:
  IeeeSubnormals() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
    saved_ = _mm_getcsr();
    _mm_setcsr(saved_ & ~0x8040u);  // FTZ (bit 15) and DAZ (bit 6) off
#elif defined(__aarch64__)
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    const uint64_t ieee = saved_ & ~(uint64_t{1} << 24);  // FZ off
    asm volatile("msr fpcr, %0" : : "r"(ieee));
#endif
  }
  ~IeeeSubnormals() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
    _mm_setcsr(saved_);
#elif defined(__aarch64__)
    asm volatile("msr fpcr, %0" : : "r"(saved_));
#endif
  }
  IeeeSubnormals(const IeeeSubnormals&) = delete;
  IeeeSubnormals& operator=(const IeeeSubnormals&) = delete;

 private:
#if defined(__aarch64__)
  uint64_t saved_ = 0;
#else
  unsigned saved_ = 0;
#endif
};

struct Leaf {
  ffi::DataType dtype;
  const void* in;
  void* out;
  int64_t size;
};

// Steps 2 and 3 for one chunk of `n` (<= kChunk) elements.
template <typename Storage>
float ChunkPartial(const typename Storage::Bits* x, int64_t n) {
  float lane[kLanes];
  for (int l = 0; l < kLanes; ++l) lane[l] = 0.0f;
  if (n == kChunk) {
    for (int k = 0; k < kSteps; ++k) {
      for (int l = 0; l < kLanes; ++l) {
        for (int j = 0; j < kVec; ++j) {
          lane[l] = clip::accumulate_square(lane[l], Storage::load(x[k * (kLanes * kVec) + l * kVec + j]));
        }
      }
    }
  } else {
    // A short chunk: walking e upwards visits each lane's elements in the same increasing order.
    for (int64_t e = 0; e < n; ++e) {
      const int l = static_cast<int>((e % (kLanes * kVec)) / kVec);
      lane[l] = clip::accumulate_square(lane[l], Storage::load(x[e]));
    }
  }
  for (int s = kLanes / 2; s >= 1; s /= 2) {
    for (int i = 0; i < s; ++i) lane[i] = clip::f_add(lane[i], lane[i + s]);
  }
  return lane[0];
}

template <typename Storage>
void LeafPartials(const void* data, int64_t size, float* slots) {
  const auto* x = static_cast<const typename Storage::Bits*>(data);
  for (int64_t off = 0; off < size; off += kChunk) {
    *slots++ = ChunkPartial<Storage>(x + off, std::min<int64_t>(kChunk, size - off));
  }
}

// Step 4.
float NormFromSlots(const float* slots, int64_t n) {
  std::vector<double> lane(kFinalLanes, 0.0);
  for (int r = 0; r < kFinalLanes; ++r) {
    double d = 0.0;
    for (int64_t i = r; i < n; i += kFinalLanes) d = clip::d_add(d, static_cast<double>(slots[i]));
    lane[r] = d;
  }
  for (int s = kFinalLanes / 2; s >= 1; s /= 2) {
    for (int i = 0; i < s; ++i) lane[i] = clip::d_add(lane[i], lane[i + s]);
  }
  return clip::norm_from_total(lane[0]);
}

int64_t ChunkCount(int64_t size) { return (size + kChunk - 1) / kChunk; }

ffi::Error CollectLeaves(const ffi::RemainingArgs& args, size_t first, std::vector<Leaf>& leaves,
                         const char* op) {
  for (size_t i = first; i < args.size(); ++i) {
    auto buf = args.get<ffi::AnyBuffer>(i);
    if (buf.has_error()) return buf.error();
    const ffi::DataType t = buf->element_type();
    if (t != ffi::F32 && t != ffi::BF16 && t != ffi::F16) {
      return ffi::Error::InvalidArgument(std::string(op) + ": leaf " + std::to_string(i - first) +
                                         " must be float32, bfloat16 or float16");
    }
    leaves.push_back(Leaf{t, buf->untyped_data(), nullptr, static_cast<int64_t>(buf->element_count())});
  }
  return ffi::Error::Success();
}

// Steps 1-4: the chunk slots (into scratch[0, N)) and the norm.
ffi::Error Norm(const std::vector<Leaf>& leaves, float* scratch, int64_t scratch_size, float* norm_out,
                const char* op) {
  int64_t chunks = 0;
  for (const Leaf& leaf : leaves) chunks += ChunkCount(leaf.size);
  if (scratch_size < chunks + 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": scratch result too small for the chunk count");
  }
  float* slot = scratch;
  for (const Leaf& leaf : leaves) {
    switch (leaf.dtype) {
      case ffi::F32: LeafPartials<F32Storage>(leaf.in, leaf.size, slot); break;
      case ffi::BF16: LeafPartials<BF16Storage>(leaf.in, leaf.size, slot); break;
      default: LeafPartials<F16Storage>(leaf.in, leaf.size, slot); break;
    }
    slot += ChunkCount(leaf.size);
  }
  *norm_out = NormFromSlots(scratch, chunks);
  return ffi::Error::Success();
}

template <typename Storage>
void ScaleLeaf(const Leaf& leaf, float scale) {
  const auto* x = static_cast<const typename Storage::Bits*>(leaf.in);
  auto* y = static_cast<typename Storage::Bits*>(leaf.out);
  for (int64_t i = 0; i < leaf.size; ++i) y[i] = clip::clip_element<Storage>(x[i], scale);
}

ffi::Error GlobalNormCpu(ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> norm,
                         ffi::Result<ffi::Buffer<ffi::F32>> scratch) {
  IeeeSubnormals ieee;
  std::vector<Leaf> leaves;
  if (auto err = CollectLeaves(args, 0, leaves, "jaxdet_global_norm"); !err.success()) return err;
  return Norm(leaves, scratch->typed_data(), static_cast<int64_t>(scratch->element_count()), norm->typed_data(),
              "jaxdet_global_norm");
}

ffi::Error ClipCpu(ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> norm,
                   ffi::Result<ffi::Buffer<ffi::F32>> scratch, ffi::RemainingRets rets, int32_t nonfinite) {
  constexpr const char* kOp = "jaxdet_clip_global_norm";
  IeeeSubnormals ieee;
  if (args.size() < 1) return ffi::Error::InvalidArgument(std::string(kOp) + ": missing max_norm");
  auto max_norm_buf = args.get<ffi::Buffer<ffi::F32>>(0);
  if (max_norm_buf.has_error()) return max_norm_buf.error();
  if (max_norm_buf->element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": max_norm must be a float32 scalar");
  }
  if (nonfinite != clip::kPropagate && nonfinite != clip::kSkip) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": unknown nonfinite policy");
  }
  std::vector<Leaf> leaves;
  if (auto err = CollectLeaves(args, 1, leaves, kOp); !err.success()) return err;
  if (rets.size() != leaves.size()) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": one result per leaf expected");
  }
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (out.has_error()) return out.error();
    if ((*out)->element_type() != leaves[i].dtype || static_cast<int64_t>((*out)->element_count()) != leaves[i].size) {
      return ffi::Error::InvalidArgument(std::string(kOp) + ": result " + std::to_string(i) +
                                         " does not match its leaf");
    }
    leaves[i].out = (*out)->untyped_data();
  }
  float* slots = scratch->typed_data();
  const int64_t scratch_size = static_cast<int64_t>(scratch->element_count());
  if (auto err = Norm(leaves, slots, scratch_size, norm->typed_data(), kOp); !err.success()) return err;

  const clip::Decision d = clip::clip_decision(*norm->typed_data(), max_norm_buf->typed_data()[0], nonfinite);
  // The decision is also left in the scratch's last two words, as the CUDA target does.
  slots[scratch_size - 2] = d.scale;
  slots[scratch_size - 1] = f32_from_bits(d.mode);

  for (const Leaf& leaf : leaves) {
    if (leaf.size == 0) continue;
    const size_t bytes = static_cast<size_t>(leaf.size) * (leaf.dtype == ffi::F32 ? 4 : 2);
    switch (d.mode) {
      case clip::kIdentity:
        if (leaf.out != leaf.in) std::memcpy(leaf.out, leaf.in, bytes);
        break;
      case clip::kZero:
        std::memset(leaf.out, 0, bytes);
        break;
      default:
        switch (leaf.dtype) {
          case ffi::F32: ScaleLeaf<F32Storage>(leaf, d.scale); break;
          case ffi::BF16: ScaleLeaf<BF16Storage>(leaf, d.scale); break;
          default: ScaleLeaf<F16Storage>(leaf, d.scale); break;
        }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_global_norm_cpu, GlobalNormCpu,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_clip_global_norm_cpu, ClipCpu,
                              ffi::Ffi::Bind()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .RemainingRets()
                                  .Attr<int32_t>("nonfinite"));

}  // namespace jaxdet
