// Shapes, row descriptions and FFI signatures shared by the CPU and CUDA handlers of jaxdet.attention.
//
// q, o, dq [B, T, H, G, D] (query head h*G + g uses KV head h); k, v, dk, dv [B, S, H, D];
// Query (b, t) sees the keys at memory rows kv_start .. kv_start + limit - 1 of batch element b,
// which are its sequence's positions 0 .. limit - 1 (RowKeys), given by two int32 operands
// (row_a, row_b) in one of the forms of RowForm; lse2 (base-2 log-sum-exp) and delta float32
// [B, H, T, G].
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "common/ffi_common.h"
#include "common/philox.h"  // JAXDET_HD

namespace jaxdet {
namespace attn {

struct Dims {
  int64_t B, T, H, G, D, S;
};

// The primitives' row_form attribute (jaxdet/attention.py). The positions forms let a decode step
// hand its q_positions and kv_lengths to the kernels as they are, with no computation before them.
enum RowForm : int32_t {
  kStartLimit = 0,      // row_a [B, T] = kv_start, row_b [B, T] = limit (packed segments)
  kCausalPositions = 1,  // row_a [B, T] = q_position, row_b [B] = kv_length: kv_start 0, limit
                         // min(clamp(q_position, -1, S - 1) + 1, clamp(kv_length, 0, S))
  kLengths = 2,          // row_a [B, 0], row_b [B] = kv_length: kv_start 0, limit clamp(kv_length, 0, S)
};

struct RowDesc {
  const int32_t* a;
  const int32_t* b;
  int32_t form;
};

inline ffi::Error check_row_desc(const char* op, const ffi::Buffer<ffi::S32>& row_a,
                                 const ffi::Buffer<ffi::S32>& row_b, int32_t form, int64_t B, int64_t T) {
  const auto ad = row_a.dimensions(), bd = row_b.dimensions();
  const bool a_ok = ad.size() == 2 && ad[0] == B && ad[1] == (form == kLengths ? 0 : T);
  const bool b_ok =
      form == kStartLimit ? bd.size() == 2 && bd[0] == B && bd[1] == T : bd.size() == 1 && bd[0] == B;
  if (form < kStartLimit || form > kLengths) {
    return ffi::Error::InvalidArgument(std::string(op) + ": row_form must be 0, 1 or 2");
  }
  if (!a_ok || !b_ok) {
    static const char* const kExpected[] = {"row_a [B,T] and row_b [B,T]", "row_a [B,T] and row_b [B]",
                                            "row_a [B,0] and row_b [B]"};
    return ffi::Error::InvalidArgument(std::string(op) + ": expected " + kExpected[form]);
  }
  return ffi::Error::Success();
}

inline RowDesc row_desc(const ffi::Buffer<ffi::S32>& row_a, const ffi::Buffer<ffi::S32>& row_b, int32_t form) {
  return RowDesc{row_a.typed_data(), row_b.typed_data(), form};
}

inline ffi::Error check_dims(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                             const ffi::AnyBuffer& v, const ffi::Buffer<ffi::S32>& row_a,
                             const ffi::Buffer<ffi::S32>& row_b, int32_t form, Dims* dims) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument(std::string(op) + ": expected q [B,T,H,G,D], k and v [B,S,H,D]");
  }
  Dims d{qd[0], qd[1], qd[2], qd[3], qd[4], kd[1]};
  for (int i = 0; i < 4; ++i) {
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument(std::string(op) + ": k and v shapes differ");
  }
  if (kd[0] != d.B || kd[2] != d.H || kd[3] != d.D) {
    return ffi::Error::InvalidArgument(std::string(op) + ": inconsistent shapes");
  }
  if (auto err = check_row_desc(op, row_a, row_b, form, d.B, d.T); !err.success()) return err;
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

JAXDET_HD int64_t clamp_i64(int64_t x, int64_t lo, int64_t hi) { return x < lo ? lo : (x > hi ? hi : x); }

JAXDET_HD RowKeys row_keys(const RowDesc& rows, int64_t T, int64_t S, int64_t b, int64_t t) {
  if (rows.form == kStartLimit) {
    const int64_t start = clamp_i64(rows.a[b * T + t], 0, S);
    return RowKeys{start, clamp_i64(rows.b[b * T + t], 0, S - start)};
  }
  const int64_t length = clamp_i64(rows.b[b], 0, S);
  if (rows.form == kLengths) return RowKeys{0, length};
  const int64_t seen = clamp_i64(rows.a[b * T + t], -1, S - 1) + 1;
  return RowKeys{0, seen < length ? seen : length};
}

// The FFI signatures, shared by the CPU and CUDA handlers so that both take the one call that
// jaxdet/attention.py makes: the buffers follow the platform's context (the thread pool on the
// CPU, the stream on CUDA), and CUDA binds its workspace result (attention_workspace.h) between
// the buffers and the attributes.

// jaxdet_attention_fwd: (q, k, v, row_a, row_b) -> (o, lse2).
template <typename Binding>
auto bind_fwd_buffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>();
}

template <typename Binding>
auto bind_fwd_attrs(Binding&& binding) {
  return std::forward<Binding>(binding).template Attr<float>("scale_log2").template Attr<int32_t>("row_form");
}

// jaxdet_attention_bwd: (q, k, v, o, lse2, do, row_a, row_b) -> (dq, dk, dv).
template <typename Binding>
auto bind_bwd_buffers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::F32>>()
      .template Arg<ffi::AnyBuffer>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Arg<ffi::Buffer<ffi::S32>>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::AnyBuffer>();
}

template <typename Binding>
auto bind_bwd_attrs(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<float>("scale_log2")
      .template Attr<float>("scale")
      .template Attr<int32_t>("row_form");
}

}  // namespace attn
}  // namespace jaxdet
