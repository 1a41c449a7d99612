// Introspection of the CPU GEMM (cuda/gemm/matmul_cpu.cc) for jaxdet._native.
#pragma once

#include <string>
#include <vector>

namespace jaxdet {

// "avx512", "avx2" or "generic": the variant the CPU GEMM uses in this process. Throws
// std::invalid_argument when the testing switch names a variant this CPU lacks or an unknown one.
std::string cpu_gemm_isa();
// The variants this CPU supports, best first.
std::vector<std::string> cpu_gemm_variants();

}  // namespace jaxdet
