// sm_80+ tensor-op instantiations of one (dtype, layout), both output types.
#include "gemm_sm80.cuh"
JAXDET_SM80_DEFINE(sm80_f16_tn_f16, cutlass::half_t, ColumnMajor, RowMajor, cutlass::half_t)
JAXDET_SM80_DEFINE(sm80_f16_tn_f32, cutlass::half_t, ColumnMajor, RowMajor, float)
