// The one testing switch of the native code: the environment variable JAXDET_TESTING, a
// comma-separated list of key=value items, read once per process (docs/DEVELOPING.md):
//   gemm=sm80                     the CUDA GEMM runs its sm_80 kernels on a Hopper GPU;
//   gemm_tile=ROWSxCOLS           every call of an M-bucketed CUDA GEMM kernel set runs that tile;
//   cpu_gemm=avx512|avx2|generic  the CPU GEMM variant (refused if this CPU lacks it);
//   softmax=passes                the softmax kernels' multi-pass path where clusters would fit;
//   attention=mma                 the attention forward's mma.sync kernels on Hopper (not wgmma).
// An item changes which kernel runs, so, like the device model, it is part of what the bits may
// depend on. jaxdet/_switches.py validates the variable and jaxdet's report prints the items.
#pragma once

#include <map>
#include <string>

namespace jaxdet {

inline constexpr const char* kTestingEnv = "JAXDET_TESTING";

// Every key=value item of JAXDET_TESTING as read at the first call (later changes are not seen).
const std::map<std::string, std::string>& testing_overrides();

// The value of the item `key`, or nullptr when JAXDET_TESTING does not set it.
const std::string* testing_override(const std::string& key);

}  // namespace jaxdet
