// Generated pattern: one Hopper instantiation per translation unit (parallel builds).
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE(sm90_bf16_nt_bf16, cutlass::bfloat16_t, RowMajor, ColumnMajor, void, cutlass::bfloat16_t)
