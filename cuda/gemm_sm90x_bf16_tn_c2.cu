// Benchmark variant: weight gradient bf16, cluster 2x1.
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE_X(sm90x_bf16_tn_f32acc_c2, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float, 2)
