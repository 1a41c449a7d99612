// Weight gradient: D = C + A^T B with f32 C and D (A column-major = a [T,K] read in place, B = dc
// [T,N] row-major). Ping-pong 128x128x64, cluster 1x1x1, persistent data-parallel scheduler.
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE_X(sm90_bf16_tn_f32acc, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float,
                     1, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized,
                     cute::Shape<cute::_128, cute::_128, cute::_64>)
