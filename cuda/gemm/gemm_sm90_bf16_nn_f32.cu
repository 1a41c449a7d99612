// Generated pattern: one Hopper instantiation per translation unit (parallel builds).
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE(sm90_bf16_nn_f32, cutlass::bfloat16_t, RowMajor, RowMajor, void, float)
