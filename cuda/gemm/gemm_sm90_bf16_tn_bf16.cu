// Weight gradient, one chunk: D = A^T B with bf16 D (no C): the whole dB when the tokens fit in one chunk.
// Same tile, schedule and mainloop as sm90_bf16_tn_f32acc (see gemm_sm90_bf16_tn_f32acc.cu); only the
// epilogue's types differ, and its float32 -> bf16 conversion rounds to nearest even, as astype does.
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE(sm90_bf16_tn_bf16, cutlass::bfloat16_t, ColumnMajor, RowMajor, void, cutlass::bfloat16_t)
