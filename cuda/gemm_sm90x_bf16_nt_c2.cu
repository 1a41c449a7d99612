// Benchmark variant: dA bf16, cluster 2x1 (TMA multicast of B).
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE_X(sm90x_bf16_nt_bf16_c2, cutlass::bfloat16_t, cutlass::layout::RowMajor, cutlass::layout::ColumnMajor, void, cutlass::bfloat16_t, 2)
