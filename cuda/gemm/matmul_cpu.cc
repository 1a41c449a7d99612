// CPU targets of the batch-invariant GEMM (jaxdet_gemm) and of the chunked weight-gradient GEMM
// (jaxdet_gemm_wgrad). Contract: docs/matmul.md.
//
// Design: a BLIS-style blocked GEMM. Blocks of op(A) and op(B) are packed (and widened to float32
// for bf16/f16) into contiguous micro-panels; a register-blocked micro-kernel vectorized across N
// keeps one float32 accumulator per output element and walks k in ascending order. So each output
// element is the sequential float32 sum  ((0 + a0*b0) + a1*b1) + ...  over the whole K, whatever
// M, the blocking, the row's position or the threads: row invariance by construction. K blocks
// (KC) only pause that sum in float32 memory and resume it.
//
// Variants, chosen once per process from the CPU (never from shapes): AVX-512F+FMA, AVX2+FMA (x86
// only), and a portable fallback (every CPU). The two FMA variants give identical bits (each step
// is fma(a, b, acc)); the portable fallback rounds the product first (acc + round(a*b)), so its
// bits differ from the FMA variants. Bits may therefore differ between CPUs with and without FMA,
// never between calls, shapes, thread counts or batch compositions on one machine.
//
// Threads: the output tiles are handed out from one shared counter to the calling thread and to
// tasks on XLA's intra-op thread pool (common/parallel.h); each tile is computed whole by one thread.
//
// Chunks of K (jaxdet_gemm's `chunk` attribute, GEMM_CHUNK in jaxdet/_src/matmul/matmul.py): for
// K <= chunk the sum above is the result. Otherwise chunk c covers k in [c*chunk, min((c+1)*chunk, K));
// its float32 partial is the same sequential sum over that range alone, from 0, and the partials are
// combined by the canonical tree over the chunk index (balanced, lower index first, padded to a power
// of two with absent leaves), then rounded once to the output dtype.
#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define JAXDET_X86 1
#include <immintrin.h>
#endif

#include "common/det_math.h"
#include "common/ffi_common.h"
#include "common/parallel.h"
#include "common/philox.h"
#include "common/testing.h"
#include "matmul_cpu.h"

namespace jaxdet {
namespace matmul_cpu {

enum class GemmDtype { kF32, kBF16, kF16 };

struct GemmOperand {
  const void* ptr;
  GemmDtype dtype;
  bool trans;            // A: element (i, k) at [k*ld + i]; B: element (k, j) at [j*ld + k]
  int64_t ld;            // leading dimension (elements)
  int64_t batch_stride;  // elements between batches
};

// out[l] (+)= op(A[l]) @ op(B[l or 0]),  out row-major [L, M, N].
struct GemmProblem {
  int64_t L, M, N, K;
  GemmOperand a, b;
  bool b_broadcast;
  void* out;
  GemmDtype out_dtype;
  int64_t out_batch_stride;
  bool accumulate;  // out (float32) = out + partial, once per element, after the whole K
};

// Below this many flops per extra worker, handing work to another thread costs more than it saves.
constexpr double kMinFlopsPerThread = 4.0e6;

int64_t worker_count(const GemmProblem& p, int64_t tiles, const ffi::ThreadPool& pool) {
  const double flops = 2.0 * static_cast<double>(p.L) * p.M * p.N * std::max<int64_t>(p.K, 1);
  int64_t workers = std::min<int64_t>(pool.num_threads(), tiles);
  workers = std::min<int64_t>(workers, static_cast<int64_t>(flops / kMinFlopsPerThread) + 1);
  return std::max<int64_t>(workers, 1);
}

class AlignedFloats {
 public:
  explicit AlignedFloats(int64_t n) {
    const size_t bytes = ((static_cast<size_t>(n) * sizeof(float) + 63) / 64) * 64;
    p_ = static_cast<float*>(std::aligned_alloc(64, bytes));
  }
  ~AlignedFloats() { std::free(p_); }
  AlignedFloats(const AlignedFloats&) = delete;
  AlignedFloats& operator=(const AlignedFloats&) = delete;
  float* data() { return p_; }

 private:
  float* p_;
};

// ---------------------------------------------------------------------------------------------
// AVX-512F + FMA: 12 x 32 register tile (24 zmm accumulators).
#if defined(JAXDET_X86)
#pragma GCC push_options
#pragma GCC target("avx512f,fma")
namespace avx512 {
#define JAXDET_MR 12
#define JAXDET_NR 32
#define JAXDET_MC 144
#define JAXDET_KC 256
#define JAXDET_NC 256
#define JAXDET_VEC __m512
#define JAXDET_SIMD(name) _mm512_##name
#include "matmul_cpu_fma_micro.inc"
#include "matmul_cpu_kernel.inc"
}  // namespace avx512
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------
// AVX2 + FMA: 6 x 16 register tile (12 ymm accumulators). Same bits as the AVX-512 variant.
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#define JAXDET_MR 6
#define JAXDET_NR 16
#define JAXDET_MC 144
#define JAXDET_KC 256
#define JAXDET_NC 256
#define JAXDET_VEC __m256
#define JAXDET_SIMD(name) _mm256_##name
#include "matmul_cpu_fma_micro.inc"
#include "matmul_cpu_kernel.inc"
}  // namespace avx2
#pragma GCC pop_options
#endif

// ---------------------------------------------------------------------------------------------
// Portable fallback: multiply, round, add (the file is compiled with -ffp-contract=off, so the
// compiler may not fuse them).
namespace generic {
#define JAXDET_MR 4
#define JAXDET_NR 16
#define JAXDET_MC 128
#define JAXDET_KC 256
#define JAXDET_NC 256
struct Micro {
  static void run(int64_t kc, const float* a, const float* b, float* c, int64_t ldc, bool first) {
    float acc[JAXDET_MR][JAXDET_NR];
    for (int r = 0; r < JAXDET_MR; ++r)
      for (int j = 0; j < JAXDET_NR; ++j) acc[r][j] = first ? 0.0f : c[r * ldc + j];
    for (int64_t k = 0; k < kc; ++k) {
      const float* bk = b + k * JAXDET_NR;
      for (int r = 0; r < JAXDET_MR; ++r) {
        const float av = a[k * JAXDET_MR + r];
        for (int j = 0; j < JAXDET_NR; ++j) {
          const float prod = av * bk[j];
          acc[r][j] = acc[r][j] + prod;
        }
      }
    }
    for (int r = 0; r < JAXDET_MR; ++r)
      for (int j = 0; j < JAXDET_NR; ++j) c[r * ldc + j] = acc[r][j];
  }
};
#include "matmul_cpu_kernel.inc"
}  // namespace generic

// ---------------------------------------------------------------------------------------------
// Variant selection: once per process, the best this CPU supports, or the one the testing switch
// names (JAXDET_TESTING=cpu_gemm=avx512|avx2|generic, common/testing.h), refused if this CPU lacks it.

enum Isa : int { kUnset = -1, kGeneric = 0, kAvx2 = 1, kAvx512 = 2 };
constexpr const char* kIsaNames[] = {"generic", "avx2", "avx512"};

bool isa_supported(int isa) {
#if defined(JAXDET_X86)
  __builtin_cpu_init();
  if (isa == kAvx512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  if (isa == kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == kGeneric;
}

struct IsaChoice {
  int isa = kUnset;
  std::string error;  // why the testing switch's variant was refused; empty when isa is set
};

IsaChoice choose_isa() {
  const std::string* want = testing_override("cpu_gemm");
  if (want == nullptr) {
    for (int isa : {kAvx512, kAvx2}) {
      if (isa_supported(isa)) return {isa, ""};
    }
    return {kGeneric, ""};
  }
  for (int isa : {kAvx512, kAvx2, kGeneric}) {
    if (*want != kIsaNames[isa]) continue;
    if (isa_supported(isa)) return {isa, ""};
    return {kUnset, std::string(kTestingEnv) + " has cpu_gemm=" + *want + ", which this CPU does not support"};
  }
  return {kUnset, std::string(kTestingEnv) + " has cpu_gemm=" + *want +
                      "; the accepted items are cpu_gemm=avx512, cpu_gemm=avx2 and cpu_gemm=generic"};
}

const IsaChoice& isa_choice() {
  static const IsaChoice choice = choose_isa();
  return choice;
}

ffi::Error gemm(const char* op, const GemmProblem& p, ffi::ThreadPool& pool) {
  switch (isa_choice().isa) {
#if defined(JAXDET_X86)
    case kAvx512: avx512::gemm(p, pool); break;
    case kAvx2: avx2::gemm(p, pool); break;
#endif
    case kGeneric: generic::gemm(p, pool); break;
    default: return ffi::Error::InvalidArgument(std::string(op) + ": " + isa_choice().error);
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// FFI handlers.

bool to_gemm_dtype(ffi::DataType t, GemmDtype* out) {
  switch (t) {
    case ffi::F32: *out = GemmDtype::kF32; return true;
    case ffi::BF16: *out = GemmDtype::kBF16; return true;
    case ffi::F16: *out = GemmDtype::kF16; return true;
    default: return false;
  }
}

// Elementwise passes over n floats (tree adds, the final rounding) in blocks of kElemBlock, on the
// pool: each element is computed by one thread with one operation, so the split never changes a bit.
constexpr int64_t kElemBlock = int64_t{1} << 16;

template <typename Body>
void parallel_elements(ffi::ThreadPool& pool, int64_t n, const Body& body) {
  const int64_t blocks = (n + kElemBlock - 1) / kElemBlock;
  parallel_for(pool, blocks, std::min<int64_t>(pool.num_threads(), blocks), [&body, n](int64_t blk) {
    const int64_t lo = blk * kElemBlock;
    body(lo, std::min(n, lo + kElemBlock));
  });
}

// `p` over K > chunk: the float32 partial of each chunk of K (p's kernel on that K range alone, from
// 0), combined by the canonical tree (detmath::tree_fold, each node a whole partial added
// elementwise), rounded once into p.out. tree_fold keeps the entry j of its stack of pending
// subtrees in `workspace` slot j: chunk c arrives after popcount(c) pending subtrees and lands in the
// next slot, and a merge keeps its left child's slot, so bit_length(n) + 1 slots of [L, M, N]
// float32 suffice (jaxdet/_src/matmul/matmul.py's gemm_cpu_workspace_bytes).
ffi::Error gemm_chunked(const char* op, const GemmProblem& p, int64_t chunk, ffi::ThreadPool& pool,
                        float* workspace, size_t workspace_bytes) {
  const int64_t count = p.L * p.M * p.N;
  if (count == 0) return ffi::Error::Success();
  const int64_t n = (p.K + chunk - 1) / chunk;
  int64_t slots = 1;
  while ((int64_t{1} << (slots - 1)) <= n) ++slots;  // bit_length(n) + 1
  if (workspace_bytes < static_cast<size_t>(slots * count) * sizeof(float)) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": the workspace is smaller than the chunk partials need");
  }
  const size_t a_esize = p.a.dtype == GemmDtype::kF32 ? 4 : 2;
  const size_t b_esize = p.b.dtype == GemmDtype::kF32 ? 4 : 2;
  ffi::Error status = ffi::Error::Success();
  auto chunk_partial = [&](int64_t c) {
    float* slot = workspace + __builtin_popcountll(static_cast<unsigned long long>(c)) * count;
    const int64_t k0 = c * chunk;
    GemmProblem q = p;
    q.K = std::min(chunk, p.K - k0);
    // op(A) element (i, k) sits at [k*ld + i] (transposed) or [i*ld + k]; op(B) (k, j) at [j*ld + k]
    // (transposed) or [k*ld + j]: the chunk's operands are the same layouts from an offset pointer.
    q.a.ptr = static_cast<const char*>(p.a.ptr) + a_esize * (p.a.trans ? k0 * p.a.ld : k0);
    q.b.ptr = static_cast<const char*>(p.b.ptr) + b_esize * (p.b.trans ? k0 : k0 * p.b.ld);
    q.out = slot;  // every element written before it is read
    q.out_dtype = GemmDtype::kF32;
    q.out_batch_stride = p.M * p.N;
    q.accumulate = false;
    if (!status.failure()) status = gemm(op, q, pool);
    return slot;
  };
  auto merge = [&](float* left, const float* right) {
    parallel_elements(pool, count, [left, right](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) left[i] = left[i] + right[i];
    });
    return left;
  };
  float* root = detmath::tree_fold<float*>(n, chunk_partial, merge);
  if (status.failure()) return status;
  if (p.out_dtype == GemmDtype::kF32) {
    std::memcpy(p.out, root, sizeof(float) * count);
    return ffi::Error::Success();
  }
  uint16_t* dst = static_cast<uint16_t*>(p.out);
  const bool bf16 = p.out_dtype == GemmDtype::kBF16;
  parallel_elements(pool, count, [dst, root, bf16](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = bf16 ? f32_to_bf16(root[i]) : f32_to_f16(root[i]);
  });
  return ffi::Error::Success();
}

ffi::Error GemmCpu(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out,
                   ffi::Result<ffi::AnyBuffer> workspace, bool transpose_a, bool transpose_b, int64_t chunk) {
  const char* op = "jaxdet_gemm";
  if (chunk <= 0 || chunk % 64 != 0) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": chunk must be a positive multiple of 64 elements, got " + std::to_string(chunk));
  }
  const auto ad = a.dimensions(), bd = b.dimensions(), od = out->dimensions();
  if (ad.size() != 3 || bd.size() != 3 || od.size() != 3) {
    return ffi::Error::InvalidArgument(std::string(op) + ": a, b and out must be rank 3 ([L, ., .])");
  }
  GemmDtype at, bt, ot;
  if (!to_gemm_dtype(a.element_type(), &at) || !to_gemm_dtype(b.element_type(), &bt) ||
      !to_gemm_dtype(out->element_type(), &ot)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": dtypes must be float32, bfloat16 or float16");
  }
  if (at != bt) return ffi::Error::InvalidArgument(std::string(op) + ": a and b must have the same dtype");
  if (ot != at && ot != GemmDtype::kF32) {
    return ffi::Error::InvalidArgument(std::string(op) + ": out must have a's dtype or float32");
  }
  const int64_t L = ad[0];
  const int64_t M = transpose_a ? ad[2] : ad[1];
  const int64_t K = transpose_a ? ad[1] : ad[2];
  const int64_t Lb = bd[0];
  const int64_t Kb = transpose_b ? bd[2] : bd[1];
  const int64_t N = transpose_b ? bd[1] : bd[2];
  if (Kb != K || od[0] != L || od[1] != M || od[2] != N || !(Lb == 1 || Lb == L)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": inconsistent shapes");
  }
  GemmProblem p;
  p.L = L;
  p.M = M;
  p.N = N;
  p.K = K;
  p.a = GemmOperand{a.untyped_data(), at, transpose_a, transpose_a ? M : K, M * K};
  p.b = GemmOperand{b.untyped_data(), bt, transpose_b, transpose_b ? K : N, K * N};
  p.b_broadcast = Lb == 1;
  p.out = out->untyped_data();
  p.out_dtype = ot;
  p.out_batch_stride = M * N;
  p.accumulate = false;
  if (K <= chunk) return gemm(op, p, pool);
  return gemm_chunked(op, p, chunk, pool, static_cast<float*>(workspace->untyped_data()), workspace->size_bytes());
}

// The weight-gradient chunk sequence into `dst` [L, K, N]. `acc` null: chunk 0's partial is
// written as it is (rounded once to dst_dtype, which may be bfloat16/float16 only when the tokens
// fit in one chunk) and every later chunk adds (the CUDA target does the same); otherwise dst
// (float32) starts from acc.
ffi::Error WgradChunks(const char* op, ffi::ThreadPool& pool, const float* acc, ffi::AnyBuffer a,
                       ffi::AnyBuffer dc, ffi::Span<const int64_t> od, void* dst, GemmDtype dst_dtype,
                       int64_t chunk_tokens) {
  const auto ad = a.dimensions(), dd = dc.dimensions();
  if (ad.size() != 3 || dd.size() != 3 || od.size() != 3) {
    return ffi::Error::InvalidArgument(std::string(op) + ": a, dc and out must be rank 3");
  }
  GemmDtype at, dt;
  if (!to_gemm_dtype(a.element_type(), &at) || !to_gemm_dtype(dc.element_type(), &dt) || at != dt) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": a and dc must have one dtype: float32, bfloat16 or float16");
  }
  if (chunk_tokens <= 0) return ffi::Error::InvalidArgument(std::string(op) + ": chunk_tokens must be > 0");
  const int64_t L = od[0], K = od[1], N = od[2], T = ad[1];
  if (ad[0] != L || ad[2] != K || dd[0] != L || dd[1] != T || dd[2] != N) {
    return ffi::Error::InvalidArgument(std::string(op) + ": inconsistent shapes");
  }
  const size_t dst_esize = dst_dtype == GemmDtype::kF32 ? 4 : 2;
  if (acc != nullptr && dst != acc) std::memcpy(dst, acc, sizeof(float) * L * K * N);
  if (acc == nullptr && T == 0) std::memset(dst, 0, dst_esize * L * K * N);  // +0 in every dtype
  const size_t esize = at == GemmDtype::kF32 ? 4 : 2;
  // Chunk c: out = out + a[c]^T . dc[c]; the chunk GEMM starts from 0 and adds into out once.
  for (int64_t t0 = 0; t0 < T; t0 += chunk_tokens) {
    const int64_t tc = std::min(chunk_tokens, T - t0);
    GemmProblem p;
    p.L = L;
    p.M = K;
    p.N = N;
    p.K = tc;
    // op(A) = a[l, t0:t0+tc, :]^T: element (i=feature, k=token) at [token * K + feature].
    p.a = GemmOperand{static_cast<const char*>(a.untyped_data()) + esize * t0 * K, at, true, K, T * K};
    p.b = GemmOperand{static_cast<const char*>(dc.untyped_data()) + esize * t0 * N, dt, false, N, T * N};
    p.b_broadcast = false;
    p.out = dst;
    p.out_dtype = dst_dtype;
    p.out_batch_stride = K * N;
    p.accumulate = !(acc == nullptr && t0 == 0);
    if (p.accumulate && dst_dtype != GemmDtype::kF32) {
      return ffi::Error::Internal(std::string(op) + ": a half result cannot accumulate chunks");
    }
    if (auto err = gemm(op, p, pool); err.failure()) return err;
  }
  return ffi::Error::Success();
}

ffi::Error GemmWgradCpu(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> acc, ffi::AnyBuffer a, ffi::AnyBuffer dc,
                        ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t chunk_tokens) {
  const char* op = "jaxdet_gemm_wgrad";
  const auto cd = acc.dimensions(), od = out->dimensions();
  if (cd.size() != od.size() || !std::equal(cd.begin(), cd.end(), od.begin())) {
    return ffi::Error::InvalidArgument(std::string(op) + ": acc and out must have the same shape [L,K,N]");
  }
  return WgradChunks(op, pool, acc.typed_data(), a, dc, od, out->typed_data(), GemmDtype::kF32, chunk_tokens);
}

// dB with no accumulator, in the result's dtype: float32, or a's bfloat16/float16 (the float32
// accumulator cast once, RNE, as astype does; the CUDA target casts in the last chunk's epilogue).
// One chunk: its GEMM rounds each float32 sum to the half result in its epilogue. Several chunks:
// they accumulate in `workspace`, the float32 [L, K, N] XLA provides for that case, then one cast.
ffi::Error GemmWgradInitCpu(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer dc,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                            int64_t chunk_tokens) {
  const char* op = "jaxdet_gemm_wgrad_init";
  GemmDtype at, ot;
  if (!to_gemm_dtype(a.element_type(), &at) || !to_gemm_dtype(out->element_type(), &ot) ||
      (ot != at && ot != GemmDtype::kF32)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": the result must be float32 or a's dtype");
  }
  if (chunk_tokens <= 0) return ffi::Error::InvalidArgument(std::string(op) + ": chunk_tokens must be > 0");
  const auto od = out->dimensions();
  const auto ad = a.dimensions();
  const int64_t tokens = ad.size() == 3 ? ad[1] : 0;
  if (ot == GemmDtype::kF32 || tokens <= chunk_tokens) {
    return WgradChunks(op, pool, nullptr, a, dc, od, out->untyped_data(), ot, chunk_tokens);
  }
  const int64_t n = static_cast<int64_t>(out->element_count());
  if (static_cast<int64_t>(workspace->element_count()) != n) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": the float32 workspace must be [L,K,N] when the tokens span several chunks");
  }
  float* acc = workspace->typed_data();
  if (auto err = WgradChunks(op, pool, nullptr, a, dc, od, acc, GemmDtype::kF32, chunk_tokens); err.failure()) {
    return err;
  }
  uint16_t* dst = static_cast<uint16_t*>(out->untyped_data());
  if (ot == GemmDtype::kBF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(acc[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_f16(acc[i]);
  }
  return ffi::Error::Success();
}

}  // namespace matmul_cpu

std::string cpu_gemm_isa() {
  const matmul_cpu::IsaChoice& c = matmul_cpu::isa_choice();
  if (c.isa == matmul_cpu::kUnset) throw std::invalid_argument(c.error);
  return matmul_cpu::kIsaNames[c.isa];
}

std::vector<std::string> cpu_gemm_variants() {
  std::vector<std::string> names;
  for (int isa : {matmul_cpu::kAvx512, matmul_cpu::kAvx2, matmul_cpu::kGeneric}) {
    if (matmul_cpu::isa_supported(isa)) names.emplace_back(matmul_cpu::kIsaNames[isa]);
  }
  return names;
}

}  // namespace jaxdet

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_cpu, jaxdet::matmul_cpu::GemmCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b")
                                  .Attr<int64_t>("chunk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_cpu, jaxdet::matmul_cpu::GemmWgradCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("chunk_tokens"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_init_cpu, jaxdet::matmul_cpu::GemmWgradInitCpu,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Attr<int64_t>("chunk_tokens"));
