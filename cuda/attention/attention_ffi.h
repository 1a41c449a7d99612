// Shapes and row descriptions shared by the CPU and CUDA handlers of jaxdet.attention.
//
// q, o, dq [B, T, H, G, D] (query head h*G + g uses KV head h); k, v, dk, dv [B, S, H, D];
// rows int32 [B, T, 2] = (kv_start, limit): query (b, t) sees the keys at memory rows
// kv_start .. kv_start + limit - 1 of batch element b, which are its sequence's positions
// 0 .. limit - 1; lse2 (base-2 log-sum-exp) and delta float32 [B, H, T, G].
#pragma once

#include <cstdint>
#include <string>

#include "common/ffi_common.h"
#include "common/philox.h"  // JAXDET_HD

namespace jaxdet {
namespace attn {

struct Dims {
  int64_t B, T, H, G, D, S;
};

inline ffi::Error check_dims(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                             const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& rows, Dims* dims) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), rd = rows.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || rd.size() != 3) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": expected q [B,T,H,G,D], k and v [B,S,H,D], rows [B,T,2]");
  }
  Dims d{qd[0], qd[1], qd[2], qd[3], qd[4], kd[1]};
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument(std::string(op) + ": k and v shapes differ");
  }
  if (kd[0] != d.B || kd[2] != d.H || kd[3] != d.D || rd[0] != d.B || rd[1] != d.T || rd[2] != 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": inconsistent shapes");
  }
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": q, k and v must have the same dtype");
  }
  if (d.D > 256 || d.D % 8 != 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the head dimension must be a multiple of 8 up to 256");
  }
  *dims = d;
  return ffi::Error::Success();
}

// The backward's extra operands: o and do as q (dtype and size), lse2 one float per query row.
inline ffi::Error check_backward_operands(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& o,
                                          const ffi::AnyBuffer& dout, const ffi::Buffer<ffi::F32>& lse2,
                                          const Dims& d) {
  if (o.element_type() != q.element_type() || dout.element_type() != q.element_type() ||
      o.element_count() != q.element_count() || dout.element_count() != q.element_count() ||
      static_cast<int64_t>(lse2.element_count()) != d.B * d.H * d.T * d.G) {
    return ffi::Error::InvalidArgument(std::string(op) + ": o, do and lse2 must match q");
  }
  return ffi::Error::Success();
}

// A row's visible keys, clamped to the keys that exist (kv_start in [0, S], limit in [0, S - kv_start]).
struct RowKeys {
  int64_t start, limit;
};

JAXDET_HD RowKeys row_keys(const int32_t* rows, int64_t T, int64_t S, int64_t b, int64_t t) {
  const int32_t* r = rows + (b * T + t) * 2;
  int64_t start = r[0] < 0 ? 0 : r[0];
  start = start > S ? S : start;
  int64_t limit = r[1] < 0 ? 0 : r[1];
  limit = limit > S - start ? S - start : limit;
  return RowKeys{start, limit};
}

}  // namespace attn
}  // namespace jaxdet
