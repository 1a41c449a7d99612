// True-float32 SIMT instantiations (all four layouts).
#include "gemm_sm80.cuh"
JAXDET_SIMT_DEFINE(simt_f32_nn, RowMajor, RowMajor)
JAXDET_SIMT_DEFINE(simt_f32_nt, RowMajor, ColumnMajor)
JAXDET_SIMT_DEFINE(simt_f32_tn, ColumnMajor, RowMajor)
JAXDET_SIMT_DEFINE(simt_f32_tt, ColumnMajor, ColumnMajor)
