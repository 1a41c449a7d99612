// Introspection of the CPU GEMM (cuda/matmul_cpu.cc) for jaxdet._native: which instruction-set
// variant runs, and (for tests only) switching to another supported one.
#pragma once

namespace jaxdet {

// "avx512", "avx2" or "generic": the variant the CPU GEMM uses in this process.
const char* cpu_gemm_isa();
// Switch variants; false (and no change) when `name` is unknown or this CPU lacks it.
bool set_cpu_gemm_isa(const char* name);

}  // namespace jaxdet
