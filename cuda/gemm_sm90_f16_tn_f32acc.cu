// Weight gradient: D = C + A^T B with f32 C and D (A column-major = a [T,K] read in place).
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE(sm90_f16_tn_f32acc, cutlass::half_t, ColumnMajor, RowMajor, float, float)
