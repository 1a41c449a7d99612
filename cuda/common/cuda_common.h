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

// A launch of `grid` (CTAs of `threads` threads with `smem` bytes of dynamic shared memory) in
// thread block clusters of `cluster_x` CTAs along x; the config points at `attr`, which must
// outlive it.
inline cudaLaunchConfig_t cluster_launch_config(cudaLaunchAttribute& attr, unsigned cluster_x, dim3 grid,
                                                unsigned threads, size_t smem, cudaStream_t stream) {
  attr = cudaLaunchAttribute{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster_x;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cfg;
}

// How many clusters of `cluster_x` CTAs of `kernel` (`threads` threads, `smem` bytes of dynamic
// shared memory; the kernel's attributes for both already set) `device` runs at once; 0 where it
// runs none: no cluster launch, or `kernel` not run from code compiled for sm_90 or later, the
// only code that holds the cluster kernels' bodies (a newer GPU running the sm_80 PTX reports
// ptxVersion 80). A refused query is an answer, not a launch's error: it is cleared.
template <class Kernel>
int max_active_clusters(Kernel kernel, int device, unsigned cluster_x, unsigned threads, size_t smem) {
  int supported = 0, clusters = 0;
  cudaFuncAttributes attrs{};
  if (cudaDeviceGetAttribute(&supported, cudaDevAttrClusterLaunch, device) != cudaSuccess || !supported ||
      cudaFuncGetAttributes(&attrs, kernel) != cudaSuccess || attrs.ptxVersion < 90) {
    cudaGetLastError();
    return 0;
  }
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      cluster_launch_config(attr, cluster_x, dim3(cluster_x, 1, 1), threads, smem, nullptr);
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return std::max(clusters, 0);
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
