// CPU targets of jaxdet.attention: the forward (output and base-2 log-sum-exp per row) and the
// backward (dq, dk, dv). The order of every float operation is the canonical one of
// docs/attention.md ("CPU order"); attention_math.h holds the parts shared with the GPU.
//
// Layouts: q, o, dq [B, T, H, G, D] (query head h*G + g uses KV head h); k, v, dk, dv [B, S, H, D];
// the row description (row_a, row_b, row_form; attention_ffi.h) gives query (b, t) the keys at
// memory rows kv_start .. kv_start + limit - 1 of its batch element, which are its sequence's
// positions 0 .. limit - 1; lse2 float32 [B, H, T, G].
//
// Work unit: one (b, h) pair, on XLA's intra-op thread pool. Inside a unit the keys and values
// are widened to float32 once (into per-thread scratch); every row then follows the canonical
// order on its own, so the bits of a row depend on nothing but its query, its limit and its
// sequence's keys and values.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "attention/attention_ffi.h"
#include "attention/attention_math.h"
#include "common/ffi_common.h"
#include "common/parallel.h"

namespace jaxdet {
namespace attn {
namespace {

template <typename Storage>
void widen(const void* base, int64_t offset, int64_t n, float* dst) {
  const auto* src = static_cast<const typename Storage::Bits*>(base) + offset;
  for (int64_t i = 0; i < n; ++i) dst[i] = Storage::load(src[i]);
}

template <typename Storage>
void narrow(const float* src, int64_t n, void* base, int64_t offset) {
  auto* dst = static_cast<typename Storage::Bits*>(base) + offset;
  for (int64_t i = 0; i < n; ++i) dst[i] = Storage::store(src[i]);
}

// The keys (transposed, [D][S]) or values ([S][D]) of one (b, h), widened to float32.
template <typename Storage>
void widen_kv(const void* x, const Dims& d, int64_t b, int64_t h, bool transposed, std::vector<float>& dst) {
  dst.resize(static_cast<size_t>(d.S * d.D));
  const auto* src = static_cast<const typename Storage::Bits*>(x);
  for (int64_t s = 0; s < d.S; ++s) {
    const auto* row = src + ((b * d.S + s) * d.H + h) * d.D;
    for (int64_t e = 0; e < d.D; ++e) {
      if (transposed)
        dst[e * d.S + s] = Storage::load(row[e]);
      else
        dst[s * d.D + e] = Storage::load(row[e]);
    }
  }
}

// Per thread, kept between calls (XLA's pool threads live as long as the process): vectors only
// grow, so no call allocates once the sizes have been seen.
struct Scratch {
  std::vector<float> kt, vt, kf, vf, dk, dv, q, o, dout, acc, total, x, p;
};

Scratch& thread_scratch(const Dims& d) {
  static thread_local Scratch s;
  for (auto* v : {&s.q, &s.o, &s.dout, &s.acc, &s.total}) v->resize(static_cast<size_t>(d.D));
  s.x.resize(kBlock);
  s.p.resize(kBlock);
  return s;
}

// x[j] = float32(q . k_j) * c for keys first .. first + n - 1 (memory rows): the dot product is the
// sequential float32 sum ((0 + q0*k0) + q1*k1) + ... over the head dimension, each product and
// sum rounded. The loop runs over keys innermost, so each key's sum keeps its own order.
void scores(const float* q, const float* kt, const Dims& d, int64_t first, int64_t n, float c, float* x) {
  for (int64_t j = 0; j < n; ++j) x[j] = 0.0f;
  for (int64_t e = 0; e < d.D; ++e) {
    const float qe = q[e];
    const float* ke = kt + e * d.S + first;
    for (int64_t j = 0; j < n; ++j) x[j] = dm::add(x[j], dm::mul(qe, ke[j]));
  }
  for (int64_t j = 0; j < n; ++j) x[j] = dm::mul(x[j], c);
}

// ---- Forward ----

// The operands both passes read.
struct Inputs {
  Dims d;
  const void *q, *k, *v;
  RowDesc rows;
  float c;  // scale * log2(e)
};

ffi::Error decode_inputs(const char* op, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                         const ffi::Buffer<ffi::S32>& row_a, const ffi::Buffer<ffi::S32>& row_b, int32_t row_form,
                         float scale_log2, Inputs& in) {
  if (auto err = check_dims(op, q, k, v, row_a, row_b, row_form, &in.d); !err.success()) return err;
  in.q = q.untyped_data();
  in.k = k.untyped_data();
  in.v = v.untyped_data();
  in.rows = row_desc(row_a, row_b, row_form);
  in.c = scale_log2;
  return ffi::Error::Success();
}

// Runs unit(b * H + h) for every batch element b and KV head h on the pool. A unit writes only its
// own outputs, each in a fixed order, so how the units are spread over the workers never changes a
// bit.
template <typename Unit>
void parallel_units(ffi::ThreadPool& pool, const Dims& d, Unit unit) {
  const int64_t units = d.B * d.H;
  const int64_t workers = std::min<int64_t>(pool.num_threads(), units);
  parallel_for(pool, units, workers, unit);
}

struct ForwardArgs : Inputs {
  void* o;
  float* lse2;
};

template <typename Storage>
void forward_unit(const ForwardArgs& a, int64_t unit) {
  const Dims& d = a.d;
  const int64_t b = unit / d.H, h = unit % d.H;
  Scratch& sc = thread_scratch(d);
  std::vector<float>&kt = sc.kt, &vf = sc.vf, &q = sc.q, &acc = sc.acc, &total = sc.total, &x = sc.x, &p = sc.p;
  widen_kv<Storage>(a.k, d, b, h, true, kt);
  widen_kv<Storage>(a.v, d, b, h, false, vf);
  for (int64_t t = 0; t < d.T; ++t) {
    const RowKeys keys = row_keys(a.rows, d.T, d.S, b, t);
    for (int64_t g = 0; g < d.G; ++g) {
      const int64_t qoff = (((b * d.T + t) * d.H + h) * d.G + g) * d.D;
      widen<Storage>(a.q, qoff, d.D, q.data());
      float m_total = dm::neg_inf(), l_total = 0.0f;
      std::fill(total.begin(), total.end(), 0.0f);
      for (int64_t split = 0; split * kSplit < keys.limit; ++split) {
        float m = dm::neg_inf(), l = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        const int64_t split_end = std::min<int64_t>((split + 1) * kSplit, keys.limit);
        for (int64_t pos = split * kSplit; pos < split_end; pos += kBlock) {
          const int64_t n = std::min<int64_t>(kBlock, split_end - pos);
          const int64_t first = keys.start + pos;
          scores(q.data(), kt.data(), d, first, n, a.c, x.data());
          float block_max = dm::neg_inf();
          for (int64_t j = 0; j < n; ++j) block_max = max_nan(block_max, x[j]);
          const Rescale r = rescale<CanonicalMath>(m, block_max);
          if (r.empty) continue;
          // p_j = exp2(x_j - m'); the block's sum runs over j ascending from +0.
          float block_sum = 0.0f;
          for (int64_t j = 0; j < n; ++j) {
            p[j] = exp2_canonical(dm::sub(x[j], r.m_new));
            block_sum = dm::add(block_sum, p[j]);
          }
          l = dm::add(dm::mul(l, r.old_scale), block_sum);
          // acc = acc * alpha, then + p_j * v_j for j ascending, each rounded.
          for (int64_t e = 0; e < d.D; ++e) acc[e] = dm::mul(acc[e], r.old_scale);
          for (int64_t j = 0; j < n; ++j) {
            const float pj = p[j];
            const float* vj = vf.data() + (first + j) * d.D;
            for (int64_t e = 0; e < d.D; ++e) acc[e] = dm::add(acc[e], dm::mul(pj, vj[e]));
          }
          m = r.m_new;
        }
        if (split_is_empty(m)) continue;
        const Rescale r = rescale<CanonicalMath>(m_total, m);
        l_total = merge_term(l_total, r.old_scale, l, r.in_scale);
        for (int64_t e = 0; e < d.D; ++e) total[e] = merge_term(total[e], r.old_scale, acc[e], r.in_scale);
        m_total = r.m_new;
      }
      const float inv_l = out_scale(l_total);
      for (int64_t e = 0; e < d.D; ++e) acc[e] = finish_out(total[e], inv_l);
      narrow<Storage>(acc.data(), d.D, a.o, qoff);
      a.lse2[((b * d.H + h) * d.T + t) * d.G + g] = finish_lse2<CanonicalMath>(m_total, l_total);
    }
  }
}

template <typename Storage>
void forward(ffi::ThreadPool& pool, const ForwardArgs& a) {
  parallel_units(pool, a.d, [&](int64_t unit) { forward_unit<Storage>(a, unit); });
}

ffi::Error AttentionFwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> row_a, ffi::Buffer<ffi::S32> row_b, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::Buffer<ffi::F32>> lse2, float scale_log2, int32_t row_form) {
  const char* op = "jaxdet_attention_fwd";
  ForwardArgs a;
  if (auto err = decode_inputs(op, q, k, v, row_a, row_b, row_form, scale_log2, a); !err.success()) return err;
  a.o = o->untyped_data();
  a.lse2 = lse2->typed_data();
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(q.element_type(), op, "dtype", forward<S>(pool, a));
  return ffi::Error::Success();
}

// ---- Backward ----

struct BackwardArgs : Inputs {
  const void *o, *dout;
  const float* lse2;
  void *dq, *dk, *dv;
  float scale;  // applied once to dq and dk at the end
};

// One pass over the rows (t ascending, then g) and, per row, over its visible keys ascending:
//   delta = sum_e do_e * o_e (sequential), p_j = exp2(x_j - lse2), dp_j = do . v_j (sequential),
//   ds_j = p_j * (dp_j - delta);
//   dq += ds_j * k_j (keys ascending), dk_j += ds_j * q, dv_j += p_j * do (rows ascending);
// dq and dk are multiplied by `scale` once at the end. Each sum is float32, each step rounded.
template <typename Storage>
void backward_unit(const BackwardArgs& a, int64_t unit) {
  const Dims& d = a.d;
  const int64_t b = unit / d.H, h = unit % d.H;
  Scratch& sc = thread_scratch(d);
  std::vector<float>&kt = sc.kt, &vt = sc.vt, &kf = sc.kf, &dk = sc.dk, &dv = sc.dv;
  std::vector<float>&q = sc.q, &o = sc.o, &dout = sc.dout, &dq = sc.acc, &x = sc.x, &dp = sc.p;
  widen_kv<Storage>(a.k, d, b, h, true, kt);
  widen_kv<Storage>(a.v, d, b, h, true, vt);
  widen_kv<Storage>(a.k, d, b, h, false, kf);
  dk.assign(static_cast<size_t>(d.S * d.D), 0.0f);
  dv.assign(static_cast<size_t>(d.S * d.D), 0.0f);
  for (int64_t t = 0; t < d.T; ++t) {
    const RowKeys keys = row_keys(a.rows, d.T, d.S, b, t);
    for (int64_t g = 0; g < d.G; ++g) {
      const int64_t qoff = (((b * d.T + t) * d.H + h) * d.G + g) * d.D;
      widen<Storage>(a.q, qoff, d.D, q.data());
      widen<Storage>(a.o, qoff, d.D, o.data());
      widen<Storage>(a.dout, qoff, d.D, dout.data());
      const float lse2 = a.lse2[((b * d.H + h) * d.T + t) * d.G + g];
      float delta = 0.0f;
      for (int64_t e = 0; e < d.D; ++e) delta = dm::add(delta, dm::mul(dout[e], o[e]));
      std::fill(dq.begin(), dq.end(), 0.0f);
      for (int64_t pos = 0; pos < keys.limit; pos += kBlock) {
        const int64_t n = std::min<int64_t>(kBlock, keys.limit - pos);
        const int64_t first = keys.start + pos;
        scores(q.data(), kt.data(), d, first, n, a.c, x.data());
        scores(dout.data(), vt.data(), d, first, n, 1.0f, dp.data());
        for (int64_t j = 0; j < n; ++j) {
          const float p = exp2_canonical(dm::sub(x[j], lse2));
          const float ds = dm::mul(p, dm::sub(dp[j], delta));
          const float* kj = kf.data() + (first + j) * d.D;
          float* dkj = dk.data() + (first + j) * d.D;
          float* dvj = dv.data() + (first + j) * d.D;
          for (int64_t e = 0; e < d.D; ++e) {
            dq[e] = dm::add(dq[e], dm::mul(ds, kj[e]));
            dkj[e] = dm::add(dkj[e], dm::mul(ds, q[e]));
            dvj[e] = dm::add(dvj[e], dm::mul(p, dout[e]));
          }
        }
      }
      for (int64_t e = 0; e < d.D; ++e) dq[e] = dm::mul(dq[e], a.scale);
      narrow<Storage>(dq.data(), d.D, a.dq, qoff);
    }
  }
  for (int64_t s = 0; s < d.S; ++s) {
    float* dks = dk.data() + s * d.D;
    for (int64_t e = 0; e < d.D; ++e) dks[e] = dm::mul(dks[e], a.scale);
    const int64_t off = ((b * d.S + s) * d.H + h) * d.D;
    narrow<Storage>(dks, d.D, a.dk, off);
    narrow<Storage>(dv.data() + s * d.D, d.D, a.dv, off);
  }
}

template <typename Storage>
void backward(ffi::ThreadPool& pool, const BackwardArgs& a) {
  parallel_units(pool, a.d, [&](int64_t unit) { backward_unit<Storage>(a, unit); });
}

ffi::Error AttentionBwdCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse2, ffi::AnyBuffer dout,
                           ffi::Buffer<ffi::S32> row_a, ffi::Buffer<ffi::S32> row_b,
                           ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                           ffi::Result<ffi::AnyBuffer> dv, float scale_log2, float scale, int32_t row_form) {
  const char* op = "jaxdet_attention_bwd";
  BackwardArgs a;
  if (auto err = decode_inputs(op, q, k, v, row_a, row_b, row_form, scale_log2, a); !err.success()) return err;
  if (auto err = check_backward_operands(op, q, o, dout, lse2, a.d); !err.success()) return err;
  a.o = o.untyped_data();
  a.dout = dout.untyped_data();
  a.lse2 = lse2.typed_data();
  a.dq = dq->untyped_data();
  a.dk = dk->untyped_data();
  a.dv = dv->untyped_data();
  a.scale = scale;
  IeeeSubnormalsScope ieee;
  JAXDET_DISPATCH_FLOAT(q.element_type(), op, "dtype", backward<S>(pool, a));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace attn

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdet_attention_fwd_cpu, attn::AttentionFwdCpu,
    attn::bind_fwd_attrs(attn::bind_fwd_buffers(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    jaxdet_attention_bwd_cpu, attn::AttentionBwdCpu,
    attn::bind_bwd_attrs(attn::bind_bwd_buffers(ffi::Ffi::Bind().Ctx<ffi::ThreadPool>())));

}  // namespace jaxdet
