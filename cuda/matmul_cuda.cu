// CUDA targets of the batch-invariant GEMM: jaxdet_gemm (forward, dA and the general transposed
// forms) and jaxdet_gemm_wgrad (dB as a fixed sequence of chunk GEMMs accumulated in float32).
//
// Which kernel runs is chosen from (dtype, layout, output dtype, device) alone, never from M, N,
// K or the batch: see gemm_args.h for the launchers and docs/matmul_cuda.md for the contract.
//   - float32: the CUTLASS 2.x SIMT sgemm (true float32 FFMA, never TF32) on every architecture.
//   - bfloat16/float16 on sm_90 (Hopper): CUTLASS 3.x TMA warp-specialized cooperative kernels
//     (128x256x64, persistent data-parallel scheduler) for transpose_a = False and for the weight
//     gradient; transpose_a = True runs the sm_80 kernels.
//   - bfloat16/float16 on other GPUs of compute capability >= 8.0: CUTLASS 2.x tensor-op kernels.
//   - JAXDET_GEMM_FORCE_SM80=1 (read once per process) makes a Hopper GPU run the sm_80 kernels: a
//     testing knob. It changes which kernel runs, so, like the GPU model, it is part of the
//     "device" that the bits may depend on.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "cuda_common.h"
#include "gemm_args.h"

namespace jaxdet {
namespace {

using gemm::GemmArgs;
using gemm::Status;
using Launcher = Status (*)(const GemmArgs&, cudaStream_t);

struct DeviceInfo {
  int device = 0;
  int major = 0;
  int minor = 0;
  int sms = 0;
};

constexpr int kMaxDevices = 64;

// Compute capability and SM count of the current device, read once per device.
ffi::Error current_device_info(DeviceInfo* info) {
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<DeviceInfo, kMaxDevices> infos;
  static std::array<cudaError_t, kMaxDevices> errors;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_error("cudaGetDevice", e);
  if (device < 0 || device >= kMaxDevices) return ffi::Error::Internal("jaxdet gemm: device ordinal out of range");
  std::call_once(once[device], [device] {
    DeviceInfo d;
    d.device = device;
    cudaError_t err = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
    infos[device] = d;
    errors[device] = err;
  });
  if (errors[device] != cudaSuccess) return cuda_error("cudaDeviceGetAttribute", errors[device]);
  *info = infos[device];
  return ffi::Error::Success();
}

bool force_sm80() {
  static const bool force = [] {
    const char* v = std::getenv("JAXDET_GEMM_FORCE_SM80");
    return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
  }();
  return force;
}

bool use_sm90(const DeviceInfo& d) { return d.major == 9 && d.minor == 0 && !force_sm80(); }

ffi::Error invalid(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + msg);
}

const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::F32: return "float32";
    case ffi::BF16: return "bfloat16";
    case ffi::F16: return "float16";
    default: return "an unsupported dtype";
  }
}

// Kernel for jaxdet_gemm. `out_f32`: float32 output for bfloat16/float16 inputs.
Launcher pick_gemm(const DeviceInfo& d, ffi::DataType dt, bool ta, bool tb, bool out_f32) {
  const int lay = (ta ? 2 : 0) | (tb ? 1 : 0);  // nn, nt, tn, tt
  if (dt == ffi::F32) {
    static constexpr Launcher simt[4] = {gemm::simt_f32_nn, gemm::simt_f32_nt, gemm::simt_f32_tn, gemm::simt_f32_tt};
    return simt[lay];
  }
  const bool bf16 = dt == ffi::BF16;
  if (use_sm90(d) && !ta) {
    static constexpr Launcher h_bf16[2][2] = {{gemm::sm90_bf16_nn_bf16, gemm::sm90_bf16_nn_f32},
                                              {gemm::sm90_bf16_nt_bf16, gemm::sm90_bf16_nt_f32}};
    static constexpr Launcher h_f16[2][2] = {{gemm::sm90_f16_nn_f16, gemm::sm90_f16_nn_f32},
                                             {gemm::sm90_f16_nt_f16, gemm::sm90_f16_nt_f32}};
    return (bf16 ? h_bf16 : h_f16)[tb][out_f32];
  }
  static constexpr Launcher a_bf16[4][2] = {{gemm::sm80_bf16_nn_bf16, gemm::sm80_bf16_nn_f32},
                                            {gemm::sm80_bf16_nt_bf16, gemm::sm80_bf16_nt_f32},
                                            {gemm::sm80_bf16_tn_bf16, gemm::sm80_bf16_tn_f32},
                                            {gemm::sm80_bf16_tt_bf16, gemm::sm80_bf16_tt_f32}};
  static constexpr Launcher a_f16[4][2] = {{gemm::sm80_f16_nn_f16, gemm::sm80_f16_nn_f32},
                                           {gemm::sm80_f16_nt_f16, gemm::sm80_f16_nt_f32},
                                           {gemm::sm80_f16_tn_f16, gemm::sm80_f16_tn_f32},
                                           {gemm::sm80_f16_tt_f16, gemm::sm80_f16_tt_f32}};
  return (bf16 ? a_bf16 : a_f16)[lay][out_f32];
}

// Kernel for jaxdet_gemm_wgrad: D = C + A^T B, f32 C and D.
Launcher pick_wgrad(const DeviceInfo& d, ffi::DataType dt) {
  if (dt == ffi::F32) return gemm::simt_f32_tn;
  const bool bf16 = dt == ffi::BF16;
  if (use_sm90(d)) return bf16 ? gemm::sm90_bf16_tn_f32acc : gemm::sm90_f16_tn_f32acc;
  return bf16 ? gemm::sm80_bf16_tn_f32 : gemm::sm80_f16_tn_f32;
}

ffi::Error check_device(const char* op, DeviceInfo* d) {
  if (auto err = current_device_info(d); err.failure()) return err;
  if (d->major < 8) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(op) + ": needs a GPU of compute capability 8.0 or newer (this one is " +
                          std::to_string(d->major) + "." + std::to_string(d->minor) + ")");
  }
  return ffi::Error::Success();
}

// Dimensions of a rank-2 or rank-3 buffer as (L, rows, cols); rank 2 means L = 1.
bool dims3(const ffi::Span<const int64_t>& dims, int64_t* l, int64_t* r, int64_t* c) {
  if (dims.size() == 3) {
    *l = dims[0]; *r = dims[1]; *c = dims[2];
    return true;
  }
  if (dims.size() == 2) {
    *l = 1; *r = dims[0]; *c = dims[1];
    return true;
  }
  return false;
}

ffi::Error launch(const char* op, Launcher fn, const GemmArgs& g, cudaStream_t stream) {
  const Status s = fn(g, stream);
  if (s.rfind("CUTLASS cannot run", 0) == 0) return invalid(op, s);
  if (!s.empty()) return ffi::Error::Internal(std::string(op) + ": " + s);
  return ffi::Error::Success();
}

ffi::Error GemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out,
                    bool transpose_a, bool transpose_b) {
  constexpr const char* op = "jaxdet_gemm";
  const ffi::DataType dt = a.element_type();
  if (dt != ffi::F32 && dt != ffi::BF16 && dt != ffi::F16) {
    return invalid(op, "a must be float32, bfloat16 or float16");
  }
  if (b.element_type() != dt) return invalid(op, "a and b must have the same dtype");
  const ffi::DataType odt = out->element_type();
  const bool out_f32 = odt == ffi::F32 && dt != ffi::F32;
  if (odt != dt && !out_f32) {
    return invalid(op, std::string("out must be ") + dtype_name(dt) + " or (for bfloat16/float16 inputs) float32");
  }
  int64_t L, ar, ac, Lb, br, bc, Lo, om, on;
  if (!dims3(a.dimensions(), &L, &ar, &ac) || !dims3(b.dimensions(), &Lb, &br, &bc) ||
      !dims3(out->dimensions(), &Lo, &om, &on)) {
    return invalid(op, "a, b and out must be rank 3 ([L, rows, cols])");
  }
  const int64_t M = transpose_a ? ac : ar, K = transpose_a ? ar : ac;
  const int64_t N = transpose_b ? br : bc, Kb = transpose_b ? bc : br;
  if (Kb != K) return invalid(op, "the contracting dimensions of a and b differ");
  if (Lb != L && Lb != 1) return invalid(op, "b's leading (batch) dimension must be 1 or a's");
  if (Lo != L || om != M || on != N) return invalid(op, "out must have shape [L, M, N]");
  if (L == 0 || M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    const cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    if (e != cudaSuccess) return cuda_error(op, e);
    return ffi::Error::Success();
  }
  if (dt != ffi::F32) {
    // TMA / cp.async move 16 bytes: each operand's contiguous dimension must be a multiple of 8.
    const int64_t a_contig = transpose_a ? M : K, b_contig = transpose_b ? K : N;
    const int64_t out_align = out_f32 ? 4 : 8;
    if (a_contig % 8 != 0 || b_contig % 8 != 0 || N % out_align != 0) {
      return invalid(op, std::string("bfloat16/float16 operands need their contiguous dimensions to be multiples "
                                     "of 8 elements: ") +
                             (transpose_a ? "M" : "K") + "=" + std::to_string(a_contig) + ", " +
                             (transpose_b ? "K" : "N") + "=" + std::to_string(b_contig) + ", N=" +
                             std::to_string(N) + " (pad with zeros; zeros along K are exact)");
    }
  }
  DeviceInfo d;
  if (auto err = check_device(op, &d); err.failure()) return err;

  GemmArgs g;
  g.device = d.device;
  g.sm_count = d.sms;
  g.m = M;
  g.n = N;
  g.k = K;
  g.l = L;
  g.a = a.untyped_data();
  g.lda = transpose_a ? M : K;  // row-major A [M,K]; or column-major A = a stored [K,M]
  g.batch_a = M * K;
  g.b = b.untyped_data();
  g.ldb = transpose_b ? K : N;  // row-major B [K,N]; or column-major B = b stored [N,K]
  g.batch_b = Lb == 1 ? 0 : K * N;
  g.d = out->untyped_data();
  g.ldd = N;
  g.batch_d = M * N;
  g.c = g.d;
  g.ldc = g.ldd;
  g.batch_c = g.batch_d;
  g.beta = 0.0f;
  if (Lb == 1 && L > 1 && !transpose_a) {
    // b is shared and a's rows are contiguous across the batch: one GEMM of L*M rows (the same
    // per-row arithmetic; no broadcast stride for TMA).
    g.m = L * M;
    g.l = 1;
    g.batch_a = g.batch_b = g.batch_c = g.batch_d = 0;
  }
  return launch(op, pick_gemm(d, dt, transpose_a, transpose_b, out_f32), g, stream);
}

// The weight-gradient chunk sequence. `acc` is the running float32 accumulator to add into, or
// null for a call that starts from nothing: then chunk 0's partial is written as it is (beta = 0,
// no accumulator read and no zero fill) and every later chunk adds, exactly as the CPU target does.
ffi::Error WgradChunks(cudaStream_t stream, const char* op, const float* acc, ffi::AnyBuffer a, ffi::AnyBuffer dc,
                       ffi::Result<ffi::Buffer<ffi::F32>>& out, int64_t chunk_tokens) {
  const ffi::DataType dt = a.element_type();
  if (dt != ffi::F32 && dt != ffi::BF16 && dt != ffi::F16) {
    return invalid(op, "a must be float32, bfloat16 or float16");
  }
  if (dc.element_type() != dt) return invalid(op, "a and dc must have the same dtype");
  if (chunk_tokens <= 0) return invalid(op, "chunk_tokens must be positive");
  int64_t L, K, N, La, T, Ka, Ld, Td, Nd;
  if (!dims3(out->dimensions(), &L, &K, &N) || !dims3(a.dimensions(), &La, &T, &Ka) ||
      !dims3(dc.dimensions(), &Ld, &Td, &Nd)) {
    return invalid(op, "a, dc and the result must be rank 3");
  }
  if (La != L || Ld != L || Ka != K || Nd != N || Td != T) {
    return invalid(op, "shapes must be a [L,T,K], dc [L,T,N], result (and acc) [L,K,N]");
  }
  float* d_ptr = out->typed_data();
  if (acc != nullptr && static_cast<const void*>(acc) != static_cast<const void*>(d_ptr) && out->size_bytes() > 0) {
    // The result is meant to alias acc; if XLA handed a separate buffer, start it from acc.
    const cudaError_t e = cudaMemcpyAsync(d_ptr, acc, out->size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return cuda_error(op, e);
  }
  if (acc == nullptr && T == 0 && out->size_bytes() > 0) {
    const cudaError_t e = cudaMemsetAsync(d_ptr, 0, out->size_bytes(), stream);  // no tokens: dB = 0
    if (e != cudaSuccess) return cuda_error(op, e);
  }
  if (L == 0 || K == 0 || N == 0 || T == 0) return ffi::Error::Success();
  if (dt != ffi::F32 && (K % 8 != 0 || N % 8 != 0)) {
    return invalid(op, "bfloat16/float16 operands need K and N to be multiples of 8 elements (K=" +
                           std::to_string(K) + ", N=" + std::to_string(N) + "); pad with zeros");
  }
  DeviceInfo d;
  if (auto err = check_device(op, &d); err.failure()) return err;
  const Launcher fn = pick_wgrad(d, dt);
  const size_t esize = dt == ffi::F32 ? 4 : 2;
  const char* pa = static_cast<const char*>(a.untyped_data());
  const char* pdc = static_cast<const char*>(dc.untyped_data());

  GemmArgs g;
  g.device = d.device;
  g.sm_count = d.sms;
  g.m = K;
  g.n = N;
  g.l = L;
  g.lda = K;  // A' = a^T: column-major [K, T] stored as a [T, K]
  g.batch_a = T * K;
  g.ldb = N;  // B' = dc [T, N], row-major
  g.batch_b = T * N;
  g.c = d_ptr;
  g.d = d_ptr;
  g.ldc = g.ldd = N;
  g.batch_c = g.batch_d = K * N;
  // A fixed sequence of chunk GEMMs over the token dimension, in order: acc += a[c]^T dc[c].
  for (int64_t t0 = 0; t0 < T; t0 += chunk_tokens) {
    g.beta = (acc == nullptr && t0 == 0) ? 0.0f : 1.0f;
    g.k = std::min(chunk_tokens, T - t0);
    g.a = pa + static_cast<size_t>(t0 * K) * esize;
    g.b = pdc + static_cast<size_t>(t0 * N) * esize;
    if (auto err = launch(op, fn, g, stream); err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error GemmWgradCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> acc, ffi::AnyBuffer a, ffi::AnyBuffer dc,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t chunk_tokens) {
  constexpr const char* op = "jaxdet_gemm_wgrad";
  const auto ad = acc.dimensions(), od = out->dimensions();
  if (ad.size() != od.size() || !std::equal(ad.begin(), ad.end(), od.begin())) {
    return invalid(op, "acc and the result must have the same shape [L,K,N]");
  }
  return WgradChunks(stream, op, acc.typed_data(), a, dc, out, chunk_tokens);
}

ffi::Error GemmWgradInitCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer dc,
                             ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t chunk_tokens) {
  return WgradChunks(stream, "jaxdet_gemm_wgrad_init", nullptr, a, dc, out, chunk_tokens);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_cuda, GemmCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_cuda, GemmWgradCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("chunk_tokens"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_init_cuda, GemmWgradInitCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("chunk_tokens"));

}  // namespace jaxdet
