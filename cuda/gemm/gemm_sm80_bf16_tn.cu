// sm_80+ tensor-op instantiations of one (dtype, layout), both output types.
#include "gemm_sm80.cuh"
JAXDET_SM80_DEFINE(sm80_bf16_tn_bf16, cutlass::bfloat16_t, ColumnMajor, RowMajor, cutlass::bfloat16_t)
JAXDET_SM80_DEFINE(sm80_bf16_tn_f32, cutlass::bfloat16_t, ColumnMajor, RowMajor, float)
