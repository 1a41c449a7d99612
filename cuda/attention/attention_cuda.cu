// CUDA targets of jaxdet.attention (docs/attention.md).
//
// Every kernel computes each query row (or, for dK/dV, each key row) by one fixed sequence of
// operations that depends on nothing but that row's data and its visible keys, so a row's bits do
// not depend on which CTA, tile, pass or launch configuration computes it:
//
// * float32 (attention_simt.cuh): one warp per query row (per key row for dK/dV), the CPU order of
//   attention_cpu.cc step for step (sequential float32 dot products, attention_math.h's exp2/log2).
// * bfloat16/float16 (attention_mma.cuh): tensor-core tiles (mma.sync m16n8k16, float32
//   accumulation). A warp owns 16 query rows; scores are a chain of MMAs over the head dimension
//   in ascending 16-wide steps, P.V a chain over the block's keys in ascending 16-key steps; the
//   row max/sum of a block are a fixed per-lane order and a fixed butterfly across the 4 lanes
//   that share a row. The forward either merges the splits of a row in the kernel (final mode) or
//   writes each split's state and merges them in CombineKernel (split mode, for decode-like
//   shapes); both merge with the same functions in the same order, so the bits are the same.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "attention/attention_ffi.h"
#include "attention/attention_math.h"
#include "attention/attention_workspace.h"
#include "common/cuda_common.h"

namespace jaxdet {
namespace attn {
namespace {

// ---- Shared by all kernels. ----

// The transcendental functions of the tensor-core path: one hardware instruction each.
struct FastMath {
  JAXDET_HD static float exp2(float x) {
#if defined(__CUDA_ARCH__)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2_canonical(x);
#endif
  }
  JAXDET_HD static float log2(float x) {
#if defined(__CUDA_ARCH__)
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
#else
    return log2_canonical(x);
#endif
  }
};

struct Problem {
  int64_t B, T, H, G, D, S, R;  // R = T * G query rows per (b, h); row r is (t, g) = (r / G, r % G)
  const void* q;
  const void* k;
  const void* v;
  RowDesc rows;
  float c;  // scale * log2(e)
  float zero;  // +0.0f, a value ptxas cannot fold: WgmmaCore's score accumulators start from it
};

__device__ __forceinline__ int64_t q_index(const Problem& p, int64_t b, int64_t h, int64_t r) {
  const int64_t t = r / p.G, g = r - t * p.G;
  return (((b * p.T + t) * p.H + h) * p.G + g) * p.D;
}

__device__ __forceinline__ int64_t kv_index(const Problem& p, int64_t b, int64_t h, int64_t s) {
  return ((b * p.S + s) * p.H + h) * p.D;
}

// lse2 and delta are [B, H, T, G]: the rows of one (b, h) are contiguous, in row order.
__device__ __forceinline__ int64_t stat_index(const Problem& p, int64_t b, int64_t h, int64_t r) {
  return (b * p.H + h) * p.R + r;
}

template <typename Storage>
__device__ __forceinline__ float load_elem(const void* base, int64_t i) {
  return Storage::load(static_cast<const typename Storage::Bits*>(base)[i]);
}

template <typename Storage>
__device__ __forceinline__ void store_elem(void* base, int64_t i, float x) {
  static_cast<typename Storage::Bits*>(base)[i] = Storage::store(x);
}

constexpr unsigned kFullMask = 0xFFFFFFFFu;

// What the backward reads besides q, k, v and writes.
struct BackwardOut {
  const void* o;
  const void* dout;
  const float* lse2;
  float* delta;  // workspace [B, H, T, G], filled by DeltaKernel
  void* dq;
  void* dk;
  void* dv;
  float scale;
  int2* tile_ranges;     // tensor-core path: [B, query_tiles], TileRangeKernel
  int64_t query_tiles;   // ceil(R / 64)
  int* dq_fired;  // tensor-core path: a flag per dQ CTA (attention_nonfinite.cuh), at most ceil(R / 16) H B
  int* dkdv_fired;  // and per dK/dV CTA, ceil(S / 64) H B
};

unsigned grid_for(int64_t items, int threads) {
  const int64_t wanted = (items + threads - 1) / threads;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{current_sm_count()} * 16)));
}

// delta = sum_e do_e * o_e per query row, sequential over e from +0 (the CPU order): one thread
// per row.
template <typename Storage>
__global__ void __launch_bounds__(256) DeltaKernel(Problem p, const void* o, const void* dout, float* delta) {
  const int64_t n = p.B * p.H * p.R;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i % p.R, bh = i / p.R;
    const int64_t h = bh % p.H, b = bh / p.H;
    const int64_t off = q_index(p, b, h, r);
    float acc = 0.0f;
    for (int64_t e = 0; e < p.D; ++e)
      acc = dm::add(acc, dm::mul(load_elem<Storage>(dout, off + e), load_elem<Storage>(o, off + e)));
    delta[i] = acc;
  }
}

template <typename Storage>
void launch_delta(cudaStream_t stream, const Problem& p, const BackwardOut& out) {
  const int64_t n = p.B * p.H * p.R;
  if (n == 0) return;
  DeltaKernel<Storage><<<grid_for(n, 256), 256, 0, stream>>>(p, out.o, out.dout, out.delta);
}

}  // namespace
}  // namespace attn
}  // namespace jaxdet

#include "attention/attention_mma.cuh"
#include "attention/attention_simt.cuh"

namespace jaxdet {
namespace attn {
namespace {

// ---- Launchers. ----

int device_smem_optin() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 48 * 1024;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 48 * 1024;
  return bytes;
}

Problem make_problem(const Dims& d, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                     const RowDesc& rows, float c) {
  Problem p;
  p.B = d.B;
  p.T = d.T;
  p.H = d.H;
  p.G = d.G;
  p.D = d.D;
  p.S = d.S;
  p.R = d.T * d.G;
  p.q = q.untyped_data();
  p.k = k.untyped_data();
  p.v = v.untyped_data();
  p.rows = rows;
  p.c = c;
  p.zero = 0.0f;
  return p;
}

ffi::Error check_grid(const char* op, const Problem& p) {
  if (p.B > 65535 || p.H > 65535) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": at most 65535 batch elements and 65535 KV heads per call");
  }
  if (p.R >= (int64_t{1} << 31) || p.S >= (int64_t{1} << 31)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": too many rows");
  }
  return ffi::Error::Success();
}

template <class Elem>
ffi::Error forward_mma(cudaStream_t stream, const ForwardWorkspace& w, unsigned char* ws, const Problem& p,
                       void* o, float* lse2) {
  switch (p.D) {
    case 64: return launch_forward_mma<Elem, 64>(stream, w, ws, p, o, lse2, device_smem_optin());
    case 128: return launch_forward_mma<Elem, 128>(stream, w, ws, p, o, lse2, device_smem_optin());
    case 256: return launch_forward_mma<Elem, 256>(stream, w, ws, p, o, lse2, device_smem_optin());
    default:
      return ffi::Error::InvalidArgument("jaxdet_attention_fwd: head dimension must be 64, 128 or 256 on the GPU");
  }
}

// The workspace result as the lowering sized it (jaxdet/attention.py, with the same function).
ffi::Error check_workspace(const char* op, ffi::Result<ffi::Buffer<ffi::U8>>& ws, size_t bytes) {
  if (ws->element_count() < bytes) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the workspace result has " +
                                       std::to_string(ws->element_count()) + " bytes, the kernels need " +
                                       std::to_string(bytes) + " (lowered by another jaxdet version?)");
  }
  return ffi::Error::Success();
}

template <class Elem>
ffi::Error backward_mma(cudaStream_t stream, const Problem& p, const BackwardOut& out) {
  switch (p.D) {
    case 64: return launch_backward_mma<Elem, 64>(stream, p, out, device_smem_optin());
    case 128: return launch_backward_mma<Elem, 128>(stream, p, out, device_smem_optin());
    case 256: return launch_backward_mma<Elem, 256>(stream, p, out, device_smem_optin());
    default:
      return ffi::Error::InvalidArgument("jaxdet_attention_bwd: head dimension must be 64, 128 or 256 on the GPU");
  }
}

ffi::Error AttentionFwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::S32> row_a, ffi::Buffer<ffi::S32> row_b,
                            ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse2,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, float scale_log2, int32_t row_form) {
  const char* op = "jaxdet_attention_fwd";
  Dims d;
  if (auto err = check_dims(op, q, k, v, row_a, row_b, row_form, &d); !err.success()) return err;
  const Problem p = make_problem(d, q, k, v, row_desc(row_a, row_b, row_form), scale_log2);
  if (auto err = check_grid(op, p); !err.success()) return err;
  const ForwardWorkspace w = forward_workspace(d.B, d.T, d.H, d.G, d.D, d.S, q.element_type() != ffi::F32);
  if (auto err = check_workspace(op, workspace, w.bytes); !err.success()) return err;
  if (p.B * p.H * p.R == 0) return ffi::Error::Success();
  unsigned char* ws = workspace->typed_data();
  switch (q.element_type()) {
    case ffi::F32: launch_forward_simt<F32Storage>(stream, p, o->untyped_data(), lse2->typed_data()); break;
    case ffi::BF16:
      if (auto err = forward_mma<__nv_bfloat16>(stream, w, ws, p, o->untyped_data(), lse2->typed_data());
          !err.success()) {
        return err;
      }
      break;
    case ffi::F16:
      if (auto err = forward_mma<__half>(stream, w, ws, p, o->untyped_data(), lse2->typed_data());
          !err.success()) {
        return err;
      }
      break;
    default: return ffi::Error::InvalidArgument(std::string(op) + ": dtype must be float32, bfloat16 or float16");
  }
  return last_launch_error(op);
}

ffi::Error AttentionBwdCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse2, ffi::AnyBuffer dout,
                            ffi::Buffer<ffi::S32> row_a, ffi::Buffer<ffi::S32> row_b,
                            ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                            ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                            float scale_log2, float scale, int32_t row_form) {
  const char* op = "jaxdet_attention_bwd";
  Dims d;
  if (auto err = check_dims(op, q, k, v, row_a, row_b, row_form, &d); !err.success()) return err;
  if (auto err = check_backward_operands(op, q, o, dout, lse2, d); !err.success()) return err;
  const Problem p = make_problem(d, q, k, v, row_desc(row_a, row_b, row_form), scale_log2);
  if (auto err = check_grid(op, p); !err.success()) return err;
  const bool tensor_cores = q.element_type() != ffi::F32;
  const BackwardWorkspace w = backward_workspace(d.B, d.T, d.H, d.G, d.D, d.S, tensor_cores);
  if (auto err = check_workspace(op, workspace, w.bytes); !err.success()) return err;
  unsigned char* ws = workspace->typed_data();
  BackwardOut out;
  out.o = o.untyped_data();
  out.dout = dout.untyped_data();
  out.lse2 = lse2.typed_data();
  out.dq = dq->untyped_data();
  out.dk = dk->untyped_data();
  out.dv = dv->untyped_data();
  out.scale = scale;
  out.delta = reinterpret_cast<float*>(ws);
  out.query_tiles = w.query_tiles;
  out.tile_ranges = nullptr;
  out.dq_fired = out.dkdv_fired = nullptr;
  if (tensor_cores && p.B * out.query_tiles > 0) {
    out.tile_ranges = reinterpret_cast<int2*>(ws + w.ranges_offset);
    out.dq_fired = reinterpret_cast<int*>(ws + w.flags_offset);
    out.dkdv_fired = out.dq_fired + (p.R + 15) / 16 * p.H * p.B;
  }
  switch (q.element_type()) {
    case ffi::F32: launch_backward_simt<F32Storage>(stream, p, out); break;
    case ffi::BF16:
      if (auto err = backward_mma<__nv_bfloat16>(stream, p, out); !err.success()) return err;
      break;
    case ffi::F16:
      if (auto err = backward_mma<__half>(stream, p, out); !err.success()) return err;
      break;
    default: return ffi::Error::InvalidArgument(std::string(op) + ": dtype must be float32, bfloat16 or float16");
  }
  return last_launch_error(op);
}

}  // namespace
}  // namespace attn

// Both handlers take their workspace from XLA (attention_workspace.h), so XLA may record them into
// its command buffers.
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdet_attention_fwd_cuda, attn::AttentionFwdCuda,
    attn::bind_fwd_attrs(attn::bind_fwd_buffers(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                             .Ret<ffi::Buffer<ffi::U8>>()),
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdet_attention_bwd_cuda, attn::AttentionBwdCuda,
    attn::bind_bwd_attrs(attn::bind_bwd_buffers(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                             .Ret<ffi::Buffer<ffi::U8>>()),
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxdet
