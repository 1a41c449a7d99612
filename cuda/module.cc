// The nanobind module jaxdet._native: hands each XLA FFI handler to Python as a capsule, keyed by
// the platform it runs on. jaxdet/_ffi.py registers them with XLA on import.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "attention/attention_workspace.h"
#include "common/testing.h"
#include "gemm/matmul_cpu.h"
#if defined(JAXDET_WITH_CUDA)
#include "gemm/matmul_cuda.h"
#endif
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

// CPU handlers (cuda/<primitive>/*_cpu.cc).
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_philox_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_dropout_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_gemm_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_init_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_global_norm_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_clip_global_norm_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_clip_partials_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_clip_finalize_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_clip_apply_cpu);
#define JAXDET_ROWOPS_HANDLERS(X) \
  X(norm_fwd) X(norm_bwd) X(norm_param_grad) X(softmax_fwd) X(softmax_bwd) X(xent_fwd) X(xent_bwd) X(det_math)
#define JAXDET_DECLARE_CPU(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_##name##_cpu);
JAXDET_ROWOPS_HANDLERS(JAXDET_DECLARE_CPU)
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_attention_fwd_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_attention_bwd_cpu);

#if defined(JAXDET_WITH_CUDA)
// CUDA handlers (cuda/<primitive>/*_cuda.cu).
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_philox_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_dropout_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_global_norm_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_clip_global_norm_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_clip_partials_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_clip_finalize_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_clip_apply_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_gemm_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_init_cuda);
#define JAXDET_DECLARE_CUDA(name) XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_##name##_cuda);
JAXDET_ROWOPS_HANDLERS(JAXDET_DECLARE_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_attention_fwd_cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_attention_bwd_cuda);
#endif

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "Encapsulated function must be an XLA FFI handler");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_native, m) {
  m.doc() = "jaxdet native XLA FFI handlers";
  m.attr("with_cuda") =
#if defined(JAXDET_WITH_CUDA)
      true;
#else
      false;
#endif
  m.def("cpu_targets", []() {
    nb::dict d;
    d["jaxdet_philox4x32_10"] = EncapsulateFfiHandler(jaxdet_philox_cpu);
    d["jaxdet_dropout"] = EncapsulateFfiHandler(jaxdet_dropout_cpu);
    d["jaxdet_gemm"] = EncapsulateFfiHandler(jaxdet_gemm_cpu);
    d["jaxdet_gemm_wgrad"] = EncapsulateFfiHandler(jaxdet_gemm_wgrad_cpu);
    d["jaxdet_gemm_wgrad_init"] = EncapsulateFfiHandler(jaxdet_gemm_wgrad_init_cpu);
    d["jaxdet_global_norm"] = EncapsulateFfiHandler(jaxdet_global_norm_cpu);
    d["jaxdet_clip_global_norm"] = EncapsulateFfiHandler(jaxdet_clip_global_norm_cpu);
    d["jaxdet_clip_partials"] = EncapsulateFfiHandler(jaxdet_clip_partials_cpu);
    d["jaxdet_clip_finalize"] = EncapsulateFfiHandler(jaxdet_clip_finalize_cpu);
    d["jaxdet_clip_apply"] = EncapsulateFfiHandler(jaxdet_clip_apply_cpu);
#define JAXDET_ADD_CPU(name) d["jaxdet_" #name] = EncapsulateFfiHandler(jaxdet_##name##_cpu);
    JAXDET_ROWOPS_HANDLERS(JAXDET_ADD_CPU)
    d["jaxdet_attention_fwd"] = EncapsulateFfiHandler(jaxdet_attention_fwd_cpu);
    d["jaxdet_attention_bwd"] = EncapsulateFfiHandler(jaxdet_attention_bwd_cpu);
    return d;
  });
  m.def("cpu_gemm_isa", &jaxdet::cpu_gemm_isa,
        "The instruction-set variant of the CPU GEMM in this process: avx512, avx2 or generic "
        "(ValueError if JAXDET_TESTING names a variant this CPU lacks).");
  m.def("cpu_gemm_variants", &jaxdet::cpu_gemm_variants, "The CPU GEMM variants this CPU supports, best first.");
  m.def(
      "testing_overrides",
      []() {
        nb::dict d;
        for (const auto& [key, value] : jaxdet::testing_overrides()) d[key.c_str()] = value;
        return d;
      },
      "The items of the testing switch JAXDET_TESTING as the native code read them (once per process).");
  m.def(
      "attention_workspace_bytes",
      [](const std::string& pass, int64_t B, int64_t T, int64_t H, int64_t G, int64_t D, int64_t S,
         bool tensor_cores) -> size_t {
        if (pass == "fwd") return jaxdet::attn::forward_workspace(B, T, H, G, D, S, tensor_cores).bytes;
        if (pass == "bwd") return jaxdet::attn::backward_workspace(B, T, H, G, D, S, tensor_cores).bytes;
        throw nb::value_error("pass must be 'fwd' or 'bwd'");
      },
      nb::arg("pass"), nb::arg("B"), nb::arg("T"), nb::arg("H"), nb::arg("G"), nb::arg("D"), nb::arg("S"),
      nb::arg("tensor_cores"),
      "Bytes of device memory the CUDA attention kernels work in for q [B, T, H, G, D] and k, v [B, S, H, D] "
      "(tensor_cores: bfloat16 or float16): the size of the custom call's workspace result.");
  m.def(
      "attention_forward_splits",
      [](int64_t B, int64_t T, int64_t H, int64_t G, int64_t D, int64_t S, bool tensor_cores) -> int64_t {
        return jaxdet::attn::forward_workspace(B, T, H, G, D, S, tensor_cores).nsplit;
      },
      nb::arg("B"), nb::arg("T"), nb::arg("H"), nb::arg("G"), nb::arg("D"), nb::arg("S"), nb::arg("tensor_cores"),
      "The splits per row the CUDA attention forward runs for q [B, T, H, G, D] and k, v [B, S, H, D] in split "
      "mode, or 0 where it runs in final mode (the choice depends on the shapes only).");
#if defined(JAXDET_WITH_CUDA)
  m.def("gemm_cuda_tile", &jaxdet::gemm_cuda_tile, nb::arg("dtype"), nb::arg("transpose_a"),
        nb::arg("transpose_b"), nb::arg("out_f32"), nb::arg("m"), nb::arg("n"), nb::arg("l") = 1,
        "The output tile (rows, columns) the CUDA GEMM runs on the current device for l batches of m x n "
        "outputs (its M bucket, docs/matmul_cuda.md); RuntimeError without a usable CUDA device.");
  m.def("gemm_cuda_tiles", &jaxdet::gemm_cuda_tiles, nb::arg("dtype"), nb::arg("transpose_a"),
        nb::arg("transpose_b"), nb::arg("out_f32"),
        "Every output tile (rows, columns) of the CUDA GEMM kernel set for these operands on the current "
        "device, largest first.");
#endif
  m.def("cuda_targets", []() {
    nb::dict d;
#if defined(JAXDET_WITH_CUDA)
    d["jaxdet_philox4x32_10"] = EncapsulateFfiHandler(jaxdet_philox_cuda);
    d["jaxdet_dropout"] = EncapsulateFfiHandler(jaxdet_dropout_cuda);
    d["jaxdet_global_norm"] = EncapsulateFfiHandler(jaxdet_global_norm_cuda);
    d["jaxdet_clip_global_norm"] = EncapsulateFfiHandler(jaxdet_clip_global_norm_cuda);
    d["jaxdet_clip_partials"] = EncapsulateFfiHandler(jaxdet_clip_partials_cuda);
    d["jaxdet_clip_finalize"] = EncapsulateFfiHandler(jaxdet_clip_finalize_cuda);
    d["jaxdet_clip_apply"] = EncapsulateFfiHandler(jaxdet_clip_apply_cuda);
    d["jaxdet_gemm"] = EncapsulateFfiHandler(jaxdet_gemm_cuda);
    d["jaxdet_gemm_wgrad"] = EncapsulateFfiHandler(jaxdet_gemm_wgrad_cuda);
    d["jaxdet_gemm_wgrad_init"] = EncapsulateFfiHandler(jaxdet_gemm_wgrad_init_cuda);
#define JAXDET_ADD_CUDA(name) d["jaxdet_" #name] = EncapsulateFfiHandler(jaxdet_##name##_cuda);
    JAXDET_ROWOPS_HANDLERS(JAXDET_ADD_CUDA)
    d["jaxdet_attention_fwd"] = EncapsulateFfiHandler(jaxdet_attention_fwd_cuda);
    d["jaxdet_attention_bwd"] = EncapsulateFfiHandler(jaxdet_attention_bwd_cuda);
#endif
    return d;
  });
}
