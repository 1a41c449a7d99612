// Helpers shared by the CUDA handlers of every primitive.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "ffi_common.h"

namespace jaxdet {

// The largest alignment XLA's FFI scratch allocator accepts (a larger one fails the allocation); its
// blocks come from XLA's device allocator, which aligns them further.
inline constexpr size_t kFfiScratchAlignment = 16;

inline ffi::Error cuda_error(const char* op, cudaError_t status) {
  return ffi::Error::Internal(std::string(op) + ": CUDA error " + cudaGetErrorName(status) + ": " +
                              cudaGetErrorString(status));
}

inline ffi::Error last_launch_error(const char* op) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return cuda_error(op, status);
  return ffi::Error::Success();
}

// Multiprocessor count of the current device: grids are sized from it (never the results).
inline int current_sm_count() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 108;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 108;
  return std::max(sms, 1);
}

#ifdef __CUDACC__
// The maximum in one instruction (sm_80 and later): the canonical NaN when either input is NaN,
// otherwise the larger value; a zero maximum's sign is not the canonical one (detmath::max), so
// callers settle zeros apart or show that no result sees the sign.
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
#endif

}  // namespace jaxdet
