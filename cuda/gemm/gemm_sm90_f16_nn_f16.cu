// Generated pattern: one Hopper instantiation per translation unit (parallel builds).
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE(sm90_f16_nn_f16, cutlass::half_t, RowMajor, RowMajor, void, cutlass::half_t)
