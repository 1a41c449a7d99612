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

// Every FFI target, one line per primitive: X(target name, handler symbol stem), the target
// jaxdet_<name> served by jaxdet_<stem>_cpu (cuda/<primitive>/*_cpu.cc) and, in a CUDA build,
// jaxdet_<stem>_cuda (cuda/<primitive>/*_cuda.cu). A new primitive adds its line here.
// clang-format off: one line per primitive, its name last
#define JAXDET_FFI_TARGETS(X)                                                                                \
  X(philox4x32_10, philox) X(dropout, dropout)                                                 /* dropout */ \
  X(gemm, gemm) X(gemm_wgrad, gemm_wgrad) X(gemm_wgrad_init, gemm_wgrad_init)                     /* gemm */ \
  X(global_norm, global_norm) X(clip_global_norm, clip_global_norm) X(clip_partials, clip_partials)          \
      X(clip_finalize, clip_finalize) X(clip_apply, clip_apply)                                   /* clip */ \
  X(norm_fwd, norm_fwd) X(norm_bwd, norm_bwd) X(norm_param_grad, norm_param_grad)                 /* norm */ \
  X(softmax_fwd, softmax_fwd) X(softmax_bwd, softmax_bwd) X(xent_fwd, xent_fwd) X(xent_bwd, xent_bwd)        \
      X(det_math, det_math)                                                                    /* softmax */ \
  X(attention_fwd, attention_fwd) X(attention_bwd, attention_bwd)                            /* attention */ \
  X(segment_sum, segment_sum)                                                                    /* embed */ \
  X(reduce, reduce)                                                                             /* reduce */
// clang-format on

#define JAXDET_DECLARE_CPU(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_##stem##_cpu);
JAXDET_FFI_TARGETS(JAXDET_DECLARE_CPU)
#if defined(JAXDET_WITH_CUDA)
#define JAXDET_DECLARE_CUDA(name, stem) XLA_FFI_DECLARE_HANDLER_SYMBOL(jaxdet_##stem##_cuda);
JAXDET_FFI_TARGETS(JAXDET_DECLARE_CUDA)
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
#define JAXDET_ADD_CPU(name, stem) d["jaxdet_" #name] = EncapsulateFfiHandler(jaxdet_##stem##_cpu);
    JAXDET_FFI_TARGETS(JAXDET_ADD_CPU)
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
#define JAXDET_ADD_CUDA(name, stem) d["jaxdet_" #name] = EncapsulateFfiHandler(jaxdet_##stem##_cuda);
    JAXDET_FFI_TARGETS(JAXDET_ADD_CUDA)
#endif
    return d;
  });
}
