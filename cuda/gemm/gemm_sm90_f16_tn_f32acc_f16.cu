// Weight gradient, last chunk: D = C + A^T B with f32 C (the accumulator of the earlier chunks) and f16 D:
// the chunk sequence's last addition and the cast to the weight's dtype in one epilogue.
// Same tile, schedule and mainloop as sm90_f16_tn_f32acc (see gemm_sm90_f16_tn_f32acc.cu); only the
// epilogue's types differ, and its float32 -> f16 conversion rounds to nearest even, as astype does.
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE(sm90_f16_tn_f32acc_f16, cutlass::half_t, ColumnMajor, RowMajor, float, cutlass::half_t)
