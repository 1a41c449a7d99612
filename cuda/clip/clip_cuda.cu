// CUDA targets of global-norm clipping: three stream-ordered kernels, no host sync, no atomics.
//
//   pass 1  PartialKernel   one 256-thread block per 4096-element chunk (grid-stride): each thread
//                           is one lane of the canonical order (cuda/clip/clip_math.h), the block tree
//                           combines the lanes, thread 0 writes the chunk's float32 slot.
//   pass 2  FinalizeKernel  one 1024-thread block: the float64 lane sums and tree over the slots,
//                           the norm (written to the norm result) and the clip decision (mode and
//                           scale, written to device memory: the scratch result's last two words).
//   pass 3  ApplyKernel     reads the decision from device memory; identity on aliased buffers
//                           returns at once (bits untouched); otherwise scales / zeroes every chunk,
//                           in reverse chunk order (pass 1's last chunks are the likeliest in L2).
//
// The leaf table (pointers, sizes, first chunk of each leaf, dtype) travels as a kernel parameter
// (__grid_constant__, up to 1024 leaves per launch, like apex's multi_tensor_apply), so nothing is
// copied from host memory and the host never waits. More leaves run as several launches of pass 1
// and pass 3 around one pass 2; launches only decide who computes a chunk, never what it holds.
//
// The fused targets (jaxdet_clip_global_norm, jaxdet_global_norm) run the passes in one call. The
// staged targets (jaxdet_clip_partials / _finalize / _apply, cuda/clip/clip_ffi.h) run one pass each,
// over `batch` examples per leaf (vmap), with the same kernels: pass 2 runs one block per example.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "clip_ffi.h"
#include "clip_math.h"
#include "common/cuda_common.h"

namespace jaxdet {
namespace clip {
namespace {

template <int K>
struct LeafTable {
  const void* in[K];
  void* out[K];
  int64_t size[K];             // elements of one example
  int32_t chunk_begin[K + 1];  // launch-local chunk index of each leaf's first chunk; [count] = total
  uint8_t dtype[K];
  int32_t count;               // leaves in this launch (all non-empty)
  int32_t inplace;             // every out[i] == in[i]
  int64_t slot_base;           // slot of this launch's chunk 0 within an example
  int64_t batch;               // examples per leaf
  int64_t example_slots;       // slots of one example (all launches)
};

// Work item g of a launch: example g / chunks, launch-local chunk g % chunks.
struct Item {
  int64_t example;
  int32_t chunk;
};

template <int K>
__device__ __forceinline__ Item ItemOf(const LeafTable<K>& t, int64_t g) {
  if (t.batch == 1) return Item{0, static_cast<int32_t>(g)};  // no 64-bit division on the unbatched path
  const int32_t chunks = t.chunk_begin[t.count];
  return Item{g / chunks, static_cast<int32_t>(g % chunks)};
}
static_assert(sizeof(LeafTable<1024>) < 32000, "kernel parameter limit (32764 bytes)");

// The leaf that holds launch-local chunk c: the largest L with chunk_begin[L] <= c.
template <int K>
__device__ __forceinline__ int FindLeaf(const LeafTable<K>& t, int32_t c) {
  int lo = 0, hi = t.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (t.chunk_begin[mid] <= c)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

template <typename Bits>
struct alignas(kVec * sizeof(Bits)) Vec {
  Bits e[kVec];
};

// Calls visit(e) for each element e < n of this thread's lane of a chunk, in the lane's canonical
// order (steps ascending, then its kVec consecutive elements): the element-wise path of a short or
// unaligned chunk, which must visit the elements in the order of the vector path.
template <typename Visit>
__device__ __forceinline__ void ForEachLaneElement(int64_t n, Visit visit) {
  const int lane = threadIdx.x;
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int64_t e = int64_t{k} * (kLanes * kVec) + lane * kVec + j;
      if (e < n) visit(e);
    }
  }
}

// Step 2 for this thread's lane of one chunk of n elements (n <= kChunk).
template <typename Storage>
__device__ __forceinline__ float LaneSum(const typename Storage::Bits* __restrict__ x, int64_t n) {
  using Bits = typename Storage::Bits;
  const int lane = threadIdx.x;
  float acc = 0.0f;
  if (n == kChunk && (reinterpret_cast<uintptr_t>(x) % sizeof(Vec<Bits>)) == 0) {
    Vec<Bits> v[kSteps];
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
      v[k] = reinterpret_cast<const Vec<Bits>*>(x + k * (kLanes * kVec))[lane];
    }
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc = clip::accumulate_square(acc, Storage::load(v[k].e[j]));
    }
  } else {
    ForEachLaneElement(n, [&](int64_t e) { acc = clip::accumulate_square(acc, Storage::load(x[e])); });
  }
  return acc;
}

// Step 3: the fixed pairwise tree over the 256 lanes (s = 128, 64 in shared memory, 32 ... 1 in
// warp 0 with shuffles: lane i adds lane i + s, exactly the tree the CPU target walks). The result
// is valid in thread 0. Ends with a barrier so `sh` can be reused at once.
__device__ __forceinline__ float BlockTree(float v, float* sh) {
  const int t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  if (t < 128) sh[t] = detmath::add(sh[t], sh[t + 128]);
  __syncthreads();
  if (t < 64) sh[t] = detmath::add(sh[t], sh[t + 64]);
  __syncthreads();
  float r = 0.0f;
  if (t < 32) {
    r = detmath::add(sh[t], sh[t + 32]);
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) r = detmath::add(r, __shfl_down_sync(0xFFFFFFFFu, r, s));
  }
  __syncthreads();
  return r;
}

template <int K>
__global__ void __launch_bounds__(kLanes)
    PartialKernel(const __grid_constant__ LeafTable<K> t, float* __restrict__ slots) {
  __shared__ float sh[kLanes];
  const int64_t items = t.batch * t.chunk_begin[t.count];
  for (int64_t g = blockIdx.x; g < items; g += gridDim.x) {
    const Item it = ItemOf(t, g);
    const int32_t c = it.chunk;
    const int L = FindLeaf(t, c);
    const int64_t local = int64_t{c - t.chunk_begin[L]} * kChunk;
    const int64_t n = min(int64_t{kChunk}, t.size[L] - local);
    const int64_t off = it.example * t.size[L] + local;
    float acc;
    switch (t.dtype[L]) {
      case kF32: acc = LaneSum<F32Storage>(static_cast<const uint32_t*>(t.in[L]) + off, n); break;
      case kBF16: acc = LaneSum<BF16Storage>(static_cast<const uint16_t*>(t.in[L]) + off, n); break;
      default: acc = LaneSum<F16Storage>(static_cast<const uint16_t*>(t.in[L]) + off, n); break;
    }
    const float partial = BlockTree(acc, sh);
    if (threadIdx.x == 0) slots[it.example * t.example_slots + t.slot_base + c] = partial;
  }
}

// Step 4 and the decision, one block per example (slots[b * n, (b + 1) * n) -> norm_out[b],
// ctrl[2b, 2b + 2) = (scale, mode bits)). ctrl may be null (global_norm only); max_norm_stride is
// 0 for one max_norm shared by every example, 1 for one per example.
__global__ void __launch_bounds__(kFinalLanes)
    FinalizeKernel(const float* __restrict__ slots, int64_t n, const float* __restrict__ max_norm,
                   int64_t max_norm_stride, int32_t policy, float* __restrict__ norm_out,
                   float* __restrict__ ctrl) {
  __shared__ double sh[kFinalLanes];
  const int t = threadIdx.x;
  const int64_t b = blockIdx.x;
  slots += b * n;
  double d = 0.0;
  for (int64_t i = t; i < n; i += kFinalLanes) d = clip::d_add(d, static_cast<double>(slots[i]));
  sh[t] = d;
  __syncthreads();
#pragma unroll
  for (int s = kFinalLanes / 2; s >= 64; s >>= 1) {
    if (t < s) sh[t] = clip::d_add(sh[t], sh[t + s]);
    __syncthreads();
  }
  if (t < 32) {
    double r = clip::d_add(sh[t], sh[t + 32]);
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) r = clip::d_add(r, __shfl_down_sync(0xFFFFFFFFu, r, s));
    if (t == 0) {
      const float norm = clip::norm_from_total(r);
      norm_out[b] = norm;
      if (ctrl != nullptr) {
        const clip::Decision dec = clip::clip_decision(norm, max_norm[b * max_norm_stride], policy);
        ctrl[2 * b] = dec.scale;
        ctrl[2 * b + 1] = __uint_as_float(dec.mode);
      }
    }
  }
}

template <typename Storage>
__device__ __forceinline__ typename Storage::Bits ApplyOne(typename Storage::Bits x, uint32_t mode, float scale) {
  if (mode == clip::kMultiply) return clip::clip_element<Storage>(x, scale);
  if (mode == clip::kZero) return 0;
  return x;
}

template <typename Storage>
__device__ __forceinline__ void ApplyChunk(const typename Storage::Bits* x, typename Storage::Bits* y, int64_t n,
                                           uint32_t mode, float scale) {
  using Bits = typename Storage::Bits;
  const int lane = threadIdx.x;
  if (n == kChunk && (reinterpret_cast<uintptr_t>(x) % sizeof(Vec<Bits>)) == 0 &&
      (reinterpret_cast<uintptr_t>(y) % sizeof(Vec<Bits>)) == 0) {
    Vec<Bits> v[kSteps];
#pragma unroll
    for (int k = 0; k < kSteps; ++k) v[k] = reinterpret_cast<const Vec<Bits>*>(x + k * (kLanes * kVec))[lane];
#pragma unroll
    for (int k = 0; k < kSteps; ++k) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[k].e[j] = ApplyOne<Storage>(v[k].e[j], mode, scale);
      reinterpret_cast<Vec<Bits>*>(y + k * (kLanes * kVec))[lane] = v[k];
    }
  } else {
    ForEachLaneElement(n, [&](int64_t e) { y[e] = ApplyOne<Storage>(x[e], mode, scale); });
  }
}

template <int K>
__global__ void __launch_bounds__(kLanes)
    ApplyKernel(const __grid_constant__ LeafTable<K> t, const float* __restrict__ ctrl) {
  // scale == 1: the aliased leaves already hold the result.
  if (t.batch == 1 && __float_as_uint(ctrl[1]) == clip::kIdentity && t.inplace) return;
  const int64_t items = t.batch * t.chunk_begin[t.count];
  for (int64_t i = blockIdx.x; i < items; i += gridDim.x) {
    const Item it = ItemOf(t, items - 1 - i);
    const float scale = ctrl[2 * it.example];
    const uint32_t mode = __float_as_uint(ctrl[2 * it.example + 1]);
    if (mode == clip::kIdentity && t.inplace) continue;
    const int32_t c = it.chunk;
    const int L = FindLeaf(t, c);
    const int64_t local = int64_t{c - t.chunk_begin[L]} * kChunk;
    const int64_t n = min(int64_t{kChunk}, t.size[L] - local);
    const int64_t off = it.example * t.size[L] + local;
    switch (t.dtype[L]) {
      case kF32:
        ApplyChunk<F32Storage>(static_cast<const uint32_t*>(t.in[L]) + off, static_cast<uint32_t*>(t.out[L]) + off,
                               n, mode, scale);
        break;
      case kBF16:
        ApplyChunk<BF16Storage>(static_cast<const uint16_t*>(t.in[L]) + off,
                                static_cast<uint16_t*>(t.out[L]) + off, n, mode, scale);
        break;
      default:
        ApplyChunk<F16Storage>(static_cast<const uint16_t*>(t.in[L]) + off, static_cast<uint16_t*>(t.out[L]) + off,
                               n, mode, scale);
        break;
    }
  }
}

// Resident blocks per multiprocessor of a kernel (an occupancy query: host only, no sync).
template <typename Kernel>
int BlocksPerSm(Kernel kernel) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kLanes, 0) != cudaSuccess || blocks < 1) {
    cudaGetLastError();  // clear a failed query; fall back to a safe guess
    blocks = 4;
  }
  return blocks;
}

// One wave of resident blocks, grid-striding over the chunks (fewer when there are fewer chunks).
unsigned GridFor(int64_t chunks, int blocks_per_sm) {
  const int64_t cap = int64_t{current_sm_count()} * blocks_per_sm;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min(chunks, cap)));
}

// The passes a call runs. Pass 2 needs the slots of every example of every leaf of the call.
struct Passes {
  bool partials;
  bool finalize;
  bool apply;
};

// The launch tables of non-empty leaves (up to K per launch), `batch` examples per leaf.
template <int K>
std::vector<LeafTable<K>> Tables(const std::vector<Leaf>& leaves, int64_t batch) {
  std::vector<LeafTable<K>> tables;
  int64_t slot = 0;
  for (size_t first = 0; first < leaves.size(); first += K) {
    LeafTable<K> t;
    std::memset(&t, 0, sizeof(t));
    t.count = static_cast<int32_t>(std::min<size_t>(K, leaves.size() - first));
    t.inplace = 1;
    t.slot_base = slot;
    t.batch = batch;
    int64_t c = 0;
    for (int i = 0; i < t.count; ++i) {
      const Leaf& leaf = leaves[first + i];
      t.in[i] = leaf.in;
      t.out[i] = leaf.out;
      t.size[i] = leaf.size;
      t.dtype[i] = leaf.dtype;
      t.chunk_begin[i] = static_cast<int32_t>(c);
      if (leaf.out != leaf.in) t.inplace = 0;
      c += clip::chunk_count(leaf.size);
    }
    t.chunk_begin[t.count] = static_cast<int32_t>(c);
    slot += c;
    tables.push_back(t);
  }
  for (LeafTable<K>& t : tables) t.example_slots = slot;
  return tables;
}

// The passes of one call. slots: batch * (chunks of one example) floats; norm_out: batch floats;
// ctrl: 2 * batch words (scale, mode bits); max_norm: one float, or one per example when
// max_norm_stride is 1.
template <int K>
ffi::Error Launch(cudaStream_t stream, const std::vector<Leaf>& leaves, int64_t batch, Passes passes, float* slots,
                  int64_t example_chunks, const float* max_norm, int64_t max_norm_stride, int32_t policy,
                  float* norm_out, float* ctrl, const char* op) {
  const std::vector<LeafTable<K>> tables = Tables<K>(leaves, batch);
  static const int partial_per_sm = BlocksPerSm(PartialKernel<K>);
  static const int apply_per_sm = BlocksPerSm(ApplyKernel<K>);
  if (passes.partials) {
    for (const LeafTable<K>& t : tables) {
      PartialKernel<K><<<GridFor(batch * t.chunk_begin[t.count], partial_per_sm), kLanes, 0, stream>>>(t, slots);
    }
  }
  if (passes.finalize && batch > 0) {
    FinalizeKernel<<<static_cast<unsigned>(batch), kFinalLanes, 0, stream>>>(
        slots, example_chunks, max_norm, max_norm_stride, policy, norm_out, ctrl);
  }
  if (passes.apply) {
    for (const LeafTable<K>& t : tables) {
      ApplyKernel<K><<<GridFor(batch * t.chunk_begin[t.count], apply_per_sm), kLanes, 0, stream>>>(t, ctrl);
    }
  }
  return last_launch_error(op);
}

ffi::Error Run(cudaStream_t stream, const std::vector<Leaf>& all, int64_t batch, Passes passes, float* slots,
               int64_t slot_count, const float* max_norm, int64_t max_norm_stride, int32_t policy, float* norm_out,
               float* ctrl, const char* op) {
  std::vector<Leaf> leaves;
  for (const Leaf& leaf : all) {
    if (leaf.size != 0) leaves.push_back(leaf);
  }
  const int64_t chunks = clip::example_chunks(leaves);
  if (chunks > int64_t{INT32_MAX}) {
    return ffi::Error::InvalidArgument(std::string(op) + ": more than 2^31 chunks of 4096 elements");
  }
  if ((passes.partials || passes.finalize) && slot_count < batch * chunks) {
    return ffi::Error::InvalidArgument(std::string(op) + ": too few slots for the chunk count");
  }
  if (batch == 0) return ffi::Error::Success();
  const size_t n = leaves.size();
  if (n <= 32) {
    return Launch<32>(stream, leaves, batch, passes, slots, chunks, max_norm, max_norm_stride, policy, norm_out,
                      ctrl, op);
  }
  if (n <= 256) {
    return Launch<256>(stream, leaves, batch, passes, slots, chunks, max_norm, max_norm_stride, policy, norm_out,
                       ctrl, op);
  }
  return Launch<1024>(stream, leaves, batch, passes, slots, chunks, max_norm, max_norm_stride, policy, norm_out,
                      ctrl, op);
}

ffi::Error GlobalNormCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> norm,
                          ffi::Result<ffi::Buffer<ffi::F32>> scratch) {
  constexpr const char* kOp = "jaxdet_global_norm";
  std::vector<Leaf> leaves;
  if (auto err = clip::collect_leaves(args, 0, leaves, kOp); !err.success()) return err;
  return Run(stream, leaves, 1, Passes{true, true, false}, scratch->typed_data(),
             static_cast<int64_t>(scratch->element_count()), nullptr, 0, clip::kPropagate, norm->typed_data(),
             nullptr, kOp);
}

ffi::Error ClipCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> norm,
                    ffi::Result<ffi::Buffer<ffi::F32>> scratch, ffi::RemainingRets rets, int32_t nonfinite) {
  constexpr const char* kOp = "jaxdet_clip_global_norm";
  const float* max_norm = nullptr;
  std::vector<Leaf> leaves;
  if (auto err = clip::decode_clip_call(args, rets, nonfinite, max_norm, leaves, kOp); !err.success()) return err;
  const int64_t scratch_size = static_cast<int64_t>(scratch->element_count());
  if (scratch_size < 2) return ffi::Error::InvalidArgument(std::string(kOp) + ": scratch result too small");
  float* ctrl = scratch->typed_data() + scratch_size - 2;
  return Run(stream, leaves, 1, Passes{true, true, true}, scratch->typed_data(), scratch_size - 2, max_norm, 0,
             nonfinite, norm->typed_data(), ctrl, kOp);
}

// ---- Staged targets (cuda/clip/clip_ffi.h) ----

ffi::Error PartialsCuda(cudaStream_t stream, ffi::RemainingArgs args, ffi::Result<ffi::Buffer<ffi::F32>> slots,
                        ffi::RemainingRets rets) {
  constexpr const char* kOp = "jaxdet_clip_partials";
  const int64_t batch = clip::slot_batch(slots->dimensions());
  std::vector<Leaf> leaves;
  if (auto err = clip::collect_leaves(args, 0, leaves, kOp, batch); !err.success()) return err;
  if (rets.size() != 0) {
    if (auto err = clip::attach_results(rets, 0, leaves, batch, kOp); !err.success()) return err;
    for (const Leaf& leaf : leaves) {
      if (leaf.out == leaf.in || leaf.size == 0) continue;
      const cudaError_t status = cudaMemcpyAsync(
          leaf.out, leaf.in, static_cast<size_t>(leaf.size * batch * clip::bytes_per_element(leaf.dtype)),
          cudaMemcpyDeviceToDevice, stream);
      if (status != cudaSuccess) return cuda_error(kOp, status);
    }
  }
  if (static_cast<int64_t>(slots->element_count()) != batch * clip::example_chunks(leaves)) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": slots must hold batch * chunk-count floats");
  }
  return Run(stream, leaves, batch, Passes{true, false, false}, slots->typed_data(),
             static_cast<int64_t>(slots->element_count()), nullptr, 0, clip::kPropagate, nullptr, nullptr, kOp);
}

ffi::Error FinalizeCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> slots, ffi::Buffer<ffi::F32> max_norm,
                        ffi::Result<ffi::Buffer<ffi::F32>> norm, ffi::Result<ffi::Buffer<ffi::U32>> ctrl,
                        int32_t nonfinite) {
  constexpr const char* kOp = "jaxdet_clip_finalize";
  int64_t batch = 0, chunks = 0;
  if (auto err = clip::check_finalize_call(slots, max_norm, *norm, *ctrl, nonfinite, batch, chunks, kOp);
      !err.success())
    return err;
  if (batch == 0) return ffi::Error::Success();
  if (batch > int64_t{INT32_MAX})
    return ffi::Error::InvalidArgument(std::string(kOp) + ": more than 2^31 examples");
  FinalizeKernel<<<static_cast<unsigned>(batch), kFinalLanes, 0, stream>>>(
      slots.typed_data(), chunks, max_norm.typed_data(), max_norm.element_count() == 1 ? 0 : 1, nonfinite,
      norm->typed_data(), reinterpret_cast<float*>(ctrl->typed_data()));
  return last_launch_error(kOp);
}

ffi::Error ApplyCuda(cudaStream_t stream, ffi::Buffer<ffi::U32> ctrl, ffi::RemainingArgs args,
                     ffi::RemainingRets rets) {
  constexpr const char* kOp = "jaxdet_clip_apply";
  const int64_t batch = static_cast<int64_t>(ctrl.element_count() / 2);
  std::vector<Leaf> leaves;
  if (auto err = clip::collect_leaves(args, 0, leaves, kOp, batch); !err.success()) return err;
  if (auto err = clip::attach_results(rets, 0, leaves, batch, kOp); !err.success()) return err;
  return Run(stream, leaves, batch, Passes{false, false, true}, nullptr, 0, nullptr, 0, clip::kPropagate, nullptr,
             reinterpret_cast<float*>(ctrl.typed_data()), kOp);
}

}  // namespace
}  // namespace clip

// Kernels and device-to-device copies on XLA's stream only (the scratch is a result, the clip
// decision stays in device memory), so XLA may record every handler into its command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_global_norm_cuda, clip::GlobalNormCuda,
                              clip::bind_global_norm(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdet_clip_global_norm_cuda, clip::ClipCuda,
    clip::bind_clip_global_norm(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_clip_partials_cuda, clip::PartialsCuda,
                              clip::bind_partials(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_clip_finalize_cuda, clip::FinalizeCuda,
                              clip::bind_finalize(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_clip_apply_cuda, clip::ApplyCuda,
                              clip::bind_apply(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxdet
