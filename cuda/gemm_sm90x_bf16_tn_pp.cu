// Benchmark variant: weight gradient bf16, ping-pong 128x128x64 (epilogue overlaps the other
// warpgroup's mainloop).
#include "gemm_sm90.cuh"
JAXDET_SM90_DEFINE_X(sm90x_bf16_tn_f32acc_pp, cutlass::bfloat16_t, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor, float, float, 1,
                     cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized,
                     cute::Shape<cute::_128, cute::_128, cute::_64>)
