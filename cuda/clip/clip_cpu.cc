// CPU targets of global-norm clipping: the canonical order of cuda/clip/clip_math.h, walked with plain
// loops that mirror the CUDA kernels' lanes and trees exactly (same operations, same order), so the
// norm and every clipped element are bitwise equal to the GPU's.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "clip_ffi.h"
#include "clip_math.h"
#include "common/ffi_common.h"

namespace jaxdet {
namespace clip {
namespace {

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
    for (int i = 0; i < s; ++i) lane[i] = detmath::add(lane[i], lane[i + s]);
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

// Steps 1-3 for every leaf of every example: slots[b * C + ...], leaf by leaf (clip_ffi.h).
void Partials(const std::vector<clip::Leaf>& leaves, int64_t batch, float* slots) {
  for (int64_t b = 0; b < batch; ++b) {
    for (const clip::Leaf& leaf : leaves) {
      const char* in = static_cast<const char*>(leaf.in) + b * leaf.size * clip::bytes_per_element(leaf.dtype);
      switch (leaf.dtype) {
        case clip::kF32: LeafPartials<F32Storage>(in, leaf.size, slots); break;
        case clip::kBF16: LeafPartials<BF16Storage>(in, leaf.size, slots); break;
        default: LeafPartials<F16Storage>(in, leaf.size, slots); break;
      }
      slots += clip::chunk_count(leaf.size);
    }
  }
}

template <typename Storage>
void ScaleLeaf(const void* in, void* out, int64_t size, float scale) {
  const auto* x = static_cast<const typename Storage::Bits*>(in);
  auto* y = static_cast<typename Storage::Bits*>(out);
  for (int64_t i = 0; i < size; ++i) y[i] = clip::clip_element<Storage>(x[i], scale);
}

// Step 5 for one example of one leaf (`offset` elements into the leaf).
void ApplyExample(const clip::Leaf& leaf, int64_t offset, clip::Decision d) {
  if (leaf.size == 0) return;
  const int64_t width = clip::bytes_per_element(leaf.dtype);
  const void* in = static_cast<const char*>(leaf.in) + offset * width;
  void* out = static_cast<char*>(leaf.out) + offset * width;
  const size_t bytes = static_cast<size_t>(leaf.size * width);
  switch (d.mode) {
    case clip::kIdentity:
      if (out != in) std::memcpy(out, in, bytes);
      break;
    case clip::kZero: std::memset(out, 0, bytes); break;
    default:
      switch (leaf.dtype) {
        case clip::kF32: ScaleLeaf<F32Storage>(in, out, leaf.size, d.scale); break;
        case clip::kBF16: ScaleLeaf<BF16Storage>(in, out, leaf.size, d.scale); break;
        default: ScaleLeaf<F16Storage>(in, out, leaf.size, d.scale); break;
      }
  }
}

// Steps 1-4 of one call over unbatched leaves: the chunk slots (into scratch[0, N)) and the norm.
ffi::Error Norm(const std::vector<clip::Leaf>& leaves, float* scratch, int64_t scratch_size, float* norm_out,
                const char* op) {
  const int64_t chunks = clip::example_chunks(leaves);
  if (scratch_size < chunks + 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": scratch result too small for the chunk count");
  }
  Partials(leaves, 1, scratch);
  *norm_out = NormFromSlots(scratch, chunks);
  return ffi::Error::Success();
}

ffi::Error GlobalNormCpu(ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> norm,
                         ffi::Result<ffi::Buffer<ffi::F32>> scratch) {
  IeeeSubnormalsScope ieee;
  std::vector<clip::Leaf> leaves;
  if (auto err = clip::collect_leaves(args, 0, leaves, "jaxdet_global_norm"); !err.success()) return err;
  return Norm(leaves, scratch->typed_data(), static_cast<int64_t>(scratch->element_count()), norm->typed_data(),
              "jaxdet_global_norm");
}

ffi::Error ClipCpu(ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> norm,
                   ffi::Result<ffi::Buffer<ffi::F32>> scratch, ffi::RemainingRets rets, int32_t nonfinite) {
  constexpr const char* kOp = "jaxdet_clip_global_norm";
  IeeeSubnormalsScope ieee;
  const float* max_norm = nullptr;
  std::vector<clip::Leaf> leaves;
  if (auto err = clip::decode_clip_call(args, rets, nonfinite, max_norm, leaves, kOp); !err.success()) return err;
  float* slots = scratch->typed_data();
  const int64_t scratch_size = static_cast<int64_t>(scratch->element_count());
  if (auto err = Norm(leaves, slots, scratch_size, norm->typed_data(), kOp); !err.success()) return err;

  const clip::Decision d = clip::clip_decision(*norm->typed_data(), max_norm[0], nonfinite);
  // The decision is also left in the scratch's last two words, as the CUDA target does.
  slots[scratch_size - 2] = d.scale;
  slots[scratch_size - 1] = f32_from_bits(d.mode);
  for (const clip::Leaf& leaf : leaves) ApplyExample(leaf, 0, d);
  return ffi::Error::Success();
}

// ---- Staged targets (clip_ffi.h) ----

ffi::Error PartialsCpu(ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> slots,
                       ffi::RemainingRets rets) {
  constexpr const char* kOp = "jaxdet_clip_partials";
  IeeeSubnormalsScope ieee;
  const int64_t batch = clip::slot_batch(slots->dimensions());
  std::vector<clip::Leaf> leaves;
  if (auto err = clip::collect_leaves(args, 0, leaves, kOp, batch); !err.success()) return err;
  if (rets.size() != 0) {
    if (auto err = clip::attach_results(rets, 0, leaves, batch, kOp); !err.success()) return err;
    for (const clip::Leaf& leaf : leaves) {
      if (leaf.out != leaf.in) {
        std::memcpy(leaf.out, leaf.in,
                    static_cast<size_t>(leaf.size * batch * clip::bytes_per_element(leaf.dtype)));
      }
    }
  }
  if (static_cast<int64_t>(slots->element_count()) != batch * clip::example_chunks(leaves)) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": slots must hold batch * chunk-count floats");
  }
  Partials(leaves, batch, slots->typed_data());
  return ffi::Error::Success();
}

ffi::Error FinalizeCpu(ffi::Buffer<ffi::F32> slots, ffi::Buffer<ffi::F32> max_norm,
                       ffi::Result<ffi::Buffer<ffi::F32>> norm, ffi::Result<ffi::Buffer<ffi::U32>> ctrl,
                       int32_t nonfinite) {
  constexpr const char* kOp = "jaxdet_clip_finalize";
  IeeeSubnormalsScope ieee;
  int64_t batch = 0, chunks = 0;
  if (auto err = clip::check_finalize_call(slots, max_norm, *norm, *ctrl, nonfinite, batch, chunks, kOp);
      !err.success())
    return err;
  const bool per_example = max_norm.element_count() != 1;
  for (int64_t b = 0; b < batch; ++b) {
    const float n = NormFromSlots(slots.typed_data() + b * chunks, chunks);
    const clip::Decision d = clip::clip_decision(n, max_norm.typed_data()[per_example ? b : 0], nonfinite);
    norm->typed_data()[b] = n;
    ctrl->typed_data()[2 * b] = f32_bits(d.scale);
    ctrl->typed_data()[2 * b + 1] = d.mode;
  }
  return ffi::Error::Success();
}

ffi::Error ApplyCpu(ffi::Buffer<ffi::U32> ctrl, ffi::RemainingArgs args, ffi::RemainingRets rets) {
  constexpr const char* kOp = "jaxdet_clip_apply";
  IeeeSubnormalsScope ieee;
  const int64_t batch = static_cast<int64_t>(ctrl.element_count() / 2);
  std::vector<clip::Leaf> leaves;
  if (auto err = clip::collect_leaves(args, 0, leaves, kOp, batch); !err.success()) return err;
  if (auto err = clip::attach_results(rets, 0, leaves, batch, kOp); !err.success()) return err;
  for (int64_t b = 0; b < batch; ++b) {
    const clip::Decision d{ctrl.typed_data()[2 * b + 1], f32_from_bits(ctrl.typed_data()[2 * b])};
    for (const clip::Leaf& leaf : leaves) ApplyExample(leaf, b * leaf.size, d);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace clip

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_global_norm_cpu, clip::GlobalNormCpu,
                              clip::bind_global_norm(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_clip_global_norm_cpu, clip::ClipCpu,
                              clip::bind_clip_global_norm(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_clip_partials_cpu, clip::PartialsCpu, clip::bind_partials(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_clip_finalize_cpu, clip::FinalizeCpu, clip::bind_finalize(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_clip_apply_cpu, clip::ApplyCpu, clip::bind_apply(ffi::Ffi::Bind()));

}  // namespace jaxdet
