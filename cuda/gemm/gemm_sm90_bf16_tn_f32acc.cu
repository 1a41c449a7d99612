// Weight gradient: D = C + A^T B with f32 C and D (A column-major = a [T,K] read in place, B = dc
// [T,N] row-major). The fixed Hopper configuration: cooperative 128x256x64, cluster 1x1x1,
// persistent data-parallel scheduler. (Ping-pong 128x128x64 was measured too: +10% at N = 4096
// on an H200, but -20% at N = 128256 on an H100, so it was not kept.)
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE(sm90_bf16_tn_f32acc, cutlass::bfloat16_t, ColumnMajor, RowMajor, float, float)
