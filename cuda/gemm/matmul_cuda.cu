// CUDA targets of the batch-invariant GEMM: jaxdet_gemm (forward, dA and the general transposed
// forms), jaxdet_gemm_wgrad (dB as a fixed sequence of chunk GEMMs accumulated in float32) and
// jaxdet_gemm_wgrad_init (the same sequence from nothing, its result cast to bf16/f16 by the last
// chunk's epilogue).
//
// Which kernel set runs is chosen from (dtype, layout, output dtype, device) alone; within a set,
// the output tile is chosen from the shape (choose_tile, the one place of that rule). Every tile
// of a set computes every element with the same operations (gemm_args.h), so the bits depend on
// the set alone: see docs/matmul_cuda.md for the contract.
//   - float32: the CUTLASS 2.x SIMT sgemm (true float32 FFMA, never TF32) on every architecture.
//   - bfloat16/float16 on sm_90 (Hopper): CUTLASS 3.x TMA warp-specialized kernels (K tile 64,
//     persistent data-parallel scheduler; 128x256 and narrower M-bucket tiles) for
//     transpose_a = False and for the weight gradient; transpose_a = True runs the sm_80 kernels.
//   - bfloat16/float16 on other GPUs of compute capability >= 8.0: CUTLASS 2.x tensor-op kernels
//     (K tile 32; 128x128 and narrower M-bucket tiles).
//   - the testing switch JAXDET_TESTING=gemm=sm80 (common/testing.h) makes a Hopper GPU run the
//     sm_80 kernels. It changes which kernel set runs, so, like the GPU model, it is part of the
//     "device" that the bits may depend on. JAXDET_TESTING=gemm_tile=RxC makes every call of an
//     M-bucketed set run that tile, whatever the shape: the tests compare every tile with every
//     other on the same inputs (tests/test_gemm_buckets.py). It cannot change a bit.
//
// The handlers are marked compatible with XLA's command buffers (CUDA graphs): per call they only
// read the operands' shapes, enqueue kernels (and memsets/copies) on XLA's stream and never
// synchronize, allocate or keep per-stream state; the per-device facts (compute capability, SM
// count, shared-memory attribute) are set once per process and device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "common/cuda_common.h"
#include "common/det_math.h"
#include "common/testing.h"
#include "gemm_args.h"
#include "generated/gemm_launchers.h"
#include "matmul_cuda.h"

namespace jaxdet {
namespace {

using gemm::GemmArgs;
using gemm::KernelSet;
using gemm::Launcher;
using gemm::Status;
using gemm::TileKernel;

struct DeviceInfo {
  int device = 0;
  int major = 0;
  int minor = 0;
  int sms = 0;
  bool force_sm80 = false;         // JAXDET_TESTING=gemm=sm80
  int force_m = 0, force_n = 0;    // JAXDET_TESTING=gemm_tile=RxC (0: choose_tile decides)
};

constexpr int kMaxDevices = 64;

// Compute capability and SM count of the current device, read once per device.
ffi::Error current_device_info(DeviceInfo* info) {
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<DeviceInfo, kMaxDevices> infos;
  static std::array<cudaError_t, kMaxDevices> errors;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return cuda_error("cudaGetDevice", e);
  if (device < 0 || device >= kMaxDevices) return ffi::Error::Internal("jaxdet gemm: device ordinal out of range");
  std::call_once(once[device], [device] {
    DeviceInfo d;
    d.device = device;
    cudaError_t err = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
    infos[device] = d;
    errors[device] = err;
  });
  if (errors[device] != cudaSuccess) return cuda_error("cudaDeviceGetAttribute", errors[device]);
  *info = infos[device];
  return ffi::Error::Success();
}

// The item gemm of JAXDET_TESTING: absent, or sm80 (the sm_80 kernels on Hopper too).
ffi::Error testing_force_sm80(const char* op, bool* force) {
  const std::string* v = testing_override("gemm");
  *force = v != nullptr && *v == "sm80";
  if (v != nullptr && !*force) {
    return ffi::Error::InvalidArgument(std::string(op) + ": " + kTestingEnv + " has gemm=" + *v +
                                       "; the accepted item is gemm=sm80");
  }
  return ffi::Error::Success();
}

// The item gemm_tile of JAXDET_TESTING: absent, or ROWSxCOLS.
ffi::Error testing_force_tile(const char* op, int* rows, int* cols) {
  *rows = *cols = 0;
  const std::string* v = testing_override("gemm_tile");
  if (v == nullptr) return ffi::Error::Success();
  char tail = 0;
  if (std::sscanf(v->c_str(), "%dx%d%c", rows, cols, &tail) != 2 || *rows <= 0 || *cols <= 0) {
    *rows = *cols = 0;
    return ffi::Error::InvalidArgument(std::string(op) + ": " + kTestingEnv + " has gemm_tile=" + *v +
                                       "; expected ROWSxCOLS, for example gemm_tile=64x128");
  }
  return ffi::Error::Success();
}

bool use_sm90(const DeviceInfo& d) { return d.major == 9 && d.minor == 0 && !d.force_sm80; }

// Rows up to which the narrow tiles may serve a GEMM (four of their 64-row tiles). Beyond, the set's
// first tile runs, as before M buckets existed: there each narrower tile would read every slice of
// B once more per 64 rows and the operands' traffic, not idle SMs, would bound the time. (Rows that
// share one B: a batched b's batches each have their own.)
constexpr int64_t kBucketMaxRows = 256;

// The least CTAs a tile must give, in sixtieths of the SMs, for M <= 256 rows. Off Hopper, and on
// Hopper at one row of 64-row tiles, 4/5: at small M a 64-row CTA's time grows with K alone (not
// with its columns), so once every CTA runs at once more CTAs buy nothing (64x64 on 64 CTAs beat
// 64x128 on 32). At two to four rows the bytes all CTAs pull from L2 together, (rows + columns) per
// CTA and K step, bound the time, not idle SMs, and fewer CTAs of larger tiles finish sooner: 9/20
// (two rows: 64x128 on 64 CTAs for a 4096-wide output; three and four: 128x128 on 64 CTAs), and 1/3
// at three rows, where the float32-output sets, which lack 128x128, run 64x256 on 48 CTAs (4/5 left
// only 64x64 there: 192 CTAs in two waves on 132 SMs). Measured: docs/matmul_cuda.md.
int min_ctas_sixtieths(const DeviceInfo& d, int64_t m) {
  if (!use_sm90(d)) return 48;
  switch ((m + 63) / 64) {  // rows of 64-row tiles
    case 1: return 48;      // 4/5
    case 3: return 20;      // 1/3
    default: return 27;     // 9/20
  }
}

// The M-bucket rule, the only place where a shape picks a kernel: the tile of `set` for a GEMM of
// L batches of M x N outputs on `sms` SMs. Each output tile is computed by one CTA over all of K,
// so a problem with fewer tiles than SMs leaves SMs idle (at M = 1 the 128x256 tile gives a
// 4096-wide output 16 CTAs on 132 SMs, and each streams its 1/16 of B alone). For M <= 256
// the rule takes the largest tile (the set's first) that still yields at least the CTAs of
// min_ctas_sixtieths, else the smallest of them (the most CTAs); above, the first. A tile of more
// rows than max(M, 64) is passed over (its extra rows would be zeros the tensor cores multiply),
// and so is one of fewer rows than min(M, 64) (the 16-row tiles: B would be read once per 16
// rows). 64-row tiles narrower than 64 columns measured slower; the 16x32 tile (a
// mma.sync kernel, gemm_narrow.cuh) gives a 4096-wide output 128 CTAs where 16x64 gives 64, and its
// 16x16 tile a 2048-wide output 128 where 16x32 gives 64. At M <= 16, in a set with those tiles,
// a wider tile is passed over when its CTAs spill past a full wave (one per SM) into a last wave
// less than half full: those few CTAs, each streaming its slice of B over all of K, then take as
// long as a full wave (H200, 2026-11-28, matmul_bench.py: (2048, 11264) at M = 16, 64x64 on 176
// CTAs 0.71x of jnp.dot, 16x32 0.99x). One wave, or a fuller last one, keeps the wider tile: at
// M = 16 (2048, 32000) took 35 us with 64x256 on 125 CTAs against 40.5 with 16x32, and
// (4096, 128256) 0.31 ms on 501 CTAs against 0.37 (--tile-sweep).
// The choice cannot change a bit (every tile of a set has the same K sequence), only the speed.
// tests/test_gemm_buckets.py checks rows across every boundary this rule draws.
const TileKernel& choose_tile(const KernelSet& set, const DeviceInfo& d, int64_t m, int64_t n, int64_t l) {
  if (d.force_m != 0) {
    for (int i = 0; i < set.count; ++i) {
      if (set.tiles[i].tile_m == d.force_m && set.tiles[i].tile_n == d.force_n) return set.tiles[i];
    }
  }
  if (m > kBucketMaxRows) return set.tiles[0];
  const int64_t min_ctas_x60 = min_ctas_sixtieths(d, m) * int64_t{d.sms};
  const TileKernel& last = set.tiles[set.count - 1];  // the narrowest (sets come largest first)
  const bool narrow_rows = m <= gemm::narrow::kTileM && gemm::narrow::is_narrow_tile(last.tile_m, last.tile_n);
  const TileKernel* smallest = &set.tiles[0];
  for (int i = 0; i < set.count; ++i) {
    const TileKernel& t = set.tiles[i];
    if (t.tile_m > std::max<int64_t>(m, 64) || t.tile_m < std::min<int64_t>(m, 64)) continue;
    const int64_t ctas = l * ((m + t.tile_m - 1) / t.tile_m) * ((n + t.tile_n - 1) / t.tile_n);
    const int64_t last_wave = ctas % d.sms;
    if (narrow_rows && !gemm::narrow::is_narrow_tile(t.tile_m, t.tile_n) && ctas > d.sms && last_wave != 0 &&
        2 * last_wave < d.sms)
      continue;
    if (60 * ctas >= min_ctas_x60) return t;
    smallest = &t;
  }
  return *smallest;
}

// The tile of a Hopper call whose K spans `chunks` chunks, among the set's cooperative (128-row)
// tiles, the ones that run the chunk tree in one launch (gemm_sm90_chunks.cuh), or the 16x32 and
// 16x16 tiles (which do too, gemm_narrow.cuh) where the M-bucket rule picks them; null when the call
// runs chunk by chunk instead (the same bits). Beyond
// kBucketMaxRows rows the set's first tile; at fewer, the largest whose units (tiles, times the
// chunks when the tiles alone leave SMs idle and the chunks are split over CTAs) give at least 4/5
// as many CTAs as SMs, else the one with the most units.
const TileKernel* choose_chunked_tile(const KernelSet& set, const DeviceInfo& d, int64_t m, int64_t n, int64_t l,
                                      int64_t chunks) {
  // A forced tile, or the M-bucket rule's own: if it has fewer rows, the chunks run as launches of
  // it (the one-launch tree on 128-row tiles measured slower for a handful of rows:
  // benchmarks/RESULTS.md).
  const TileKernel& own = choose_tile(set, d, m, n, l);
  // The narrow kernel runs the chunk tree in its own launch, a CTA per chunk (gemm_narrow.cuh).
  const bool is_narrow = gemm::narrow::is_narrow_tile(own.tile_m, own.tile_n);
  if (d.force_m != 0 || own.tile_m != 128) return own.tile_m == 128 || is_narrow ? &own : nullptr;
  const TileKernel* best = nullptr;
  for (int i = 0; i < set.count; ++i) {
    const TileKernel& t = set.tiles[i];
    if (t.tile_m != 128) continue;
    if (m > kBucketMaxRows) return &t;
    const int64_t tiles = l * ((m + t.tile_m - 1) / t.tile_m) * ((n + t.tile_n - 1) / t.tile_n);
    const int64_t units = tiles < d.sms ? tiles * chunks : tiles;
    best = &t;
    if (5 * units >= 4 * int64_t{d.sms}) return best;
  }
  return best;
}

// A forced tile (JAXDET_TESTING=gemm_tile) that `set` does not have: an error naming its tiles.
ffi::Error check_forced_tile(const char* op, const KernelSet& set, const DeviceInfo& d) {
  if (d.force_m == 0 || set.count == 1) return ffi::Error::Success();
  std::string names;
  for (int i = 0; i < set.count; ++i) {
    if (set.tiles[i].tile_m == d.force_m && set.tiles[i].tile_n == d.force_n) return ffi::Error::Success();
    names += (i ? ", " : "") + std::to_string(set.tiles[i].tile_m) + "x" + std::to_string(set.tiles[i].tile_n);
  }
  return ffi::Error::InvalidArgument(
      std::string(op) + ": " + kTestingEnv + " has gemm_tile=" + std::to_string(d.force_m) + "x" +
      std::to_string(d.force_n) + ", which this kernel set does not have (its tiles: " + names + ")");
}

ffi::Error invalid(const char* op, const std::string& msg) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + msg);
}

const char* dtype_name(ffi::DataType t) {
  switch (t) {
    case ffi::F32: return "float32";
    case ffi::BF16: return "bfloat16";
    case ffi::F16: return "float16";
    default: return "an unsupported dtype";
  }
}

// Kernel set for jaxdet_gemm. `out_f32`: float32 output for bfloat16/float16 inputs.
KernelSet pick_gemm(const DeviceInfo& d, ffi::DataType dt, bool ta, bool tb, bool out_f32) {
  const int lay = (ta ? 2 : 0) | (tb ? 1 : 0);  // nn, nt, tn, tt
  if (dt == ffi::F32) {
    static constexpr KernelSet simt[4] = {gemm::simt_f32_nn, gemm::simt_f32_nt, gemm::simt_f32_tn,
                                          gemm::simt_f32_tt};
    return simt[lay];
  }
  const bool bf16 = dt == ffi::BF16;
  if (use_sm90(d) && !ta) {
    static constexpr KernelSet h_bf16[2][2] = {{gemm::sm90_bf16_nn_bf16, gemm::sm90_bf16_nn_f32},
                                               {gemm::sm90_bf16_nt_bf16, gemm::sm90_bf16_nt_f32}};
    static constexpr KernelSet h_f16[2][2] = {{gemm::sm90_f16_nn_f16, gemm::sm90_f16_nn_f32},
                                              {gemm::sm90_f16_nt_f16, gemm::sm90_f16_nt_f32}};
    return (bf16 ? h_bf16 : h_f16)[tb][out_f32];
  }
  static constexpr KernelSet a_bf16[4][2] = {{gemm::sm80_bf16_nn_bf16, gemm::sm80_bf16_nn_f32},
                                             {gemm::sm80_bf16_nt_bf16, gemm::sm80_bf16_nt_f32},
                                             {gemm::sm80_bf16_tn_bf16, gemm::sm80_bf16_tn_f32},
                                             {gemm::sm80_bf16_tt_bf16, gemm::sm80_bf16_tt_f32}};
  static constexpr KernelSet a_f16[4][2] = {{gemm::sm80_f16_nn_f16, gemm::sm80_f16_nn_f32},
                                            {gemm::sm80_f16_nt_f16, gemm::sm80_f16_nt_f32},
                                            {gemm::sm80_f16_tn_f16, gemm::sm80_f16_tn_f32},
                                            {gemm::sm80_f16_tt_f16, gemm::sm80_f16_tt_f32}};
  return (bf16 ? a_bf16 : a_f16)[lay][out_f32];
}

// Kernel for jaxdet_gemm_wgrad: D = C + A^T B, f32 C and D. One tile (its rows are the weight's K).
Launcher pick_wgrad(const DeviceInfo& d, ffi::DataType dt) {
  if (dt == ffi::F32) return gemm::simt_f32_tn_128x128;
  const bool bf16 = dt == ffi::BF16;
  if (use_sm90(d)) return bf16 ? gemm::sm90_bf16_tn_f32acc_128x256 : gemm::sm90_f16_tn_f32acc_128x256;
  return bf16 ? gemm::sm80_bf16_tn_f32_128x128 : gemm::sm80_f16_tn_f32_128x128;
}

ffi::Error check_device(const char* op, DeviceInfo* d) {
  if (auto err = current_device_info(d); err.failure()) return err;
  if (auto err = testing_force_sm80(op, &d->force_sm80); err.failure()) return err;
  if (auto err = testing_force_tile(op, &d->force_m, &d->force_n); err.failure()) return err;
  if (d->major < 8) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented,
                      std::string(op) + ": needs a GPU of compute capability 8.0 or newer (this one is " +
                          std::to_string(d->major) + "." + std::to_string(d->minor) + ")");
  }
  return ffi::Error::Success();
}

// Dimensions of a rank-2 or rank-3 buffer as (L, rows, cols); rank 2 means L = 1.
bool dims3(const ffi::Span<const int64_t>& dims, int64_t* l, int64_t* r, int64_t* c) {
  if (dims.size() == 3) {
    *l = dims[0];
    *r = dims[1];
    *c = dims[2];
    return true;
  }
  if (dims.size() == 2) {
    *l = 1;
    *r = dims[0];
    *c = dims[1];
    return true;
  }
  return false;
}

ffi::Error launch(const char* op, Launcher fn, const GemmArgs& g, cudaStream_t stream) {
  const Status s = fn(g, stream);
  if (s.find("cannot run this problem") != std::string::npos) return invalid(op, s);
  if (!s.empty()) return ffi::Error::Internal(std::string(op) + ": " + s);
  return ffi::Error::Success();
}

// out[i] = cast(tree(p[0][i], ..., p[n-1][i])), p[c] = partials + c * count: the canonical tree of
// `n` float32 chunk partials element by element (detmath::tree_fold), cast once with round to
// nearest even as the GEMM epilogues convert (n = 1: the cast alone).
template <typename Out>
__global__ void ChunkTreeKernel(const float* __restrict__ partials, int64_t n, int64_t count,
                                Out* __restrict__ out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float root = detmath::tree_fold<float>(
        n, [&](int64_t c) { return partials[c * count + i]; },
        [](float left, float right) { return detmath::add(left, right); });
    if constexpr (std::is_same_v<Out, float>) {
      out[i] = root;
    } else if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
      out[i] = __float2bfloat16_rn(root);
    } else {
      out[i] = __float2half_rn(root);
    }
  }
}

ffi::Error chunk_tree(cudaStream_t stream, const char* op, ffi::DataType odt, const float* partials, int64_t n,
                      int64_t count, void* out) {
  const unsigned grid =
      static_cast<unsigned>(std::min<int64_t>((count + 255) / 256, int64_t{current_sm_count()} * 16));
  switch (odt) {
    case ffi::F32: ChunkTreeKernel<<<grid, 256, 0, stream>>>(partials, n, count, static_cast<float*>(out)); break;
    case ffi::BF16:
      ChunkTreeKernel<<<grid, 256, 0, stream>>>(partials, n, count, static_cast<__nv_bfloat16*>(out));
      break;
    default: ChunkTreeKernel<<<grid, 256, 0, stream>>>(partials, n, count, static_cast<__half*>(out)); break;
  }
  return last_launch_error(op);
}

// The float32 partials of the chunks of K (chunk c covers k in [c * chunk, min((c + 1) * chunk, K)),
// each from 0 with the same kernels as an unchunked call of that K range) into `partials`
// [n, L, M, N], then their canonical tree into `out`. The full chunks are one batched launch (their
// operands are the same matrices at a fixed offset along K), the short last chunk a second one.
ffi::Error chunked_gemm(cudaStream_t stream, const char* op, const DeviceInfo& d, const GemmArgs& g, int64_t chunk,
                        bool transpose_a, bool transpose_b, ffi::DataType dt, ffi::DataType odt, float* partials,
                        void* out) {
  const int64_t n = (g.k + chunk - 1) / chunk, full = g.k / chunk;
  const int64_t count = g.l * g.m * g.n;  // one partial's elements
  const size_t esize = dt == ffi::F32 ? 4 : 2;
  // Element offsets of one chunk along K: A row-major [M, K] or column-major ([K, M] stored); B
  // row-major [K, N] or column-major ([N, K] stored).
  const int64_t step_a = transpose_a ? chunk * g.lda : chunk;
  const int64_t step_b = transpose_b ? chunk : chunk * g.ldb;
  const KernelSet set = pick_gemm(d, dt, transpose_a, transpose_b, /*out_f32=*/true);
  if (auto err = check_forced_tile(op, set, d); err.failure()) return err;
  auto chunk_args = [&](int64_t c, int64_t k) {
    GemmArgs gc = g;
    gc.k = k;
    gc.a = static_cast<const char*>(g.a) + static_cast<size_t>(c * step_a) * esize;
    gc.b = static_cast<const char*>(g.b) + static_cast<size_t>(c * step_b) * esize;
    gc.d = partials + c * count;
    gc.c = gc.d;
    gc.beta = 0.0f;
    return gc;
  };
  if (full > 0) {
    GemmArgs gc = chunk_args(0, chunk);
    if (g.l == 1) {  // every full chunk in one launch: chunk c is batch c
      gc.l = full;
      gc.batch_a = step_a;
      gc.batch_b = step_b;
      gc.batch_d = gc.batch_c = count;
      if (auto err = launch(op, choose_tile(set, d, gc.m, gc.n, gc.l).launch, gc, stream); err.failure())
        return err;
    } else {
      for (int64_t c = 0; c < full; ++c) {
        gc = chunk_args(c, chunk);
        if (auto err = launch(op, choose_tile(set, d, gc.m, gc.n, gc.l).launch, gc, stream); err.failure()) {
          return err;
        }
      }
    }
  }
  if (full < n) {
    const GemmArgs gc = chunk_args(full, g.k - full * chunk);
    if (auto err = launch(op, choose_tile(set, d, gc.m, gc.n, gc.l).launch, gc, stream); err.failure()) return err;
  }
  return chunk_tree(stream, op, odt, partials, n, count, out);
}

ffi::Error GemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer> out,
                    ffi::Result<ffi::AnyBuffer> workspace, bool transpose_a, bool transpose_b, int64_t chunk) {
  constexpr const char* op = "jaxdet_gemm";
  if (chunk <= 0 || chunk % 64 != 0) {
    return invalid(op, "chunk must be a positive multiple of 64 elements, got " + std::to_string(chunk));
  }
  const ffi::DataType dt = a.element_type();
  if (dt != ffi::F32 && dt != ffi::BF16 && dt != ffi::F16) {
    return invalid(op, "a must be float32, bfloat16 or float16");
  }
  if (b.element_type() != dt) return invalid(op, "a and b must have the same dtype");
  const ffi::DataType odt = out->element_type();
  const bool out_f32 = odt == ffi::F32 && dt != ffi::F32;
  if (odt != dt && !out_f32) {
    return invalid(op, std::string("out must be ") + dtype_name(dt) + " or (for bfloat16/float16 inputs) float32");
  }
  int64_t L, ar, ac, Lb, br, bc, Lo, om, on;
  if (!dims3(a.dimensions(), &L, &ar, &ac) || !dims3(b.dimensions(), &Lb, &br, &bc) ||
      !dims3(out->dimensions(), &Lo, &om, &on)) {
    return invalid(op, "a, b and out must be rank 3 ([L, rows, cols])");
  }
  const int64_t M = transpose_a ? ac : ar, K = transpose_a ? ar : ac;
  const int64_t N = transpose_b ? br : bc, Kb = transpose_b ? bc : br;
  if (Kb != K) return invalid(op, "the contracting dimensions of a and b differ");
  if (Lb != L && Lb != 1) return invalid(op, "b's leading (batch) dimension must be 1 or a's");
  if (Lo != L || om != M || on != N) return invalid(op, "out must have shape [L, M, N]");
  if (L == 0 || M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    const cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);
    if (e != cudaSuccess) return cuda_error(op, e);
    return ffi::Error::Success();
  }
  if (dt != ffi::F32) {
    // TMA / cp.async move 16 bytes: each operand's contiguous dimension must be a multiple of 8.
    const int64_t a_contig = transpose_a ? M : K, b_contig = transpose_b ? K : N;
    const int64_t out_align = out_f32 ? 4 : 8;
    if (a_contig % 8 != 0 || b_contig % 8 != 0 || N % out_align != 0) {
      return invalid(op, std::string("bfloat16/float16 operands need their contiguous dimensions to be multiples "
                                     "of 8 elements: ") +
                             (transpose_a ? "M" : "K") + "=" + std::to_string(a_contig) + ", " +
                             (transpose_b ? "K" : "N") + "=" + std::to_string(b_contig) +
                             ", N=" + std::to_string(N) + " (pad with zeros; zeros along K are exact)");
    }
  }
  DeviceInfo d;
  if (auto err = check_device(op, &d); err.failure()) return err;

  GemmArgs g;
  g.device = d.device;
  g.sm_count = d.sms;
  g.m = M;
  g.n = N;
  g.k = K;
  g.l = L;
  g.a = a.untyped_data();
  g.lda = transpose_a ? M : K;  // row-major A [M,K]; or column-major A = a stored [K,M]
  g.batch_a = M * K;
  g.b = b.untyped_data();
  g.ldb = transpose_b ? K : N;  // row-major B [K,N]; or column-major B = b stored [N,K]
  g.batch_b = Lb == 1 ? 0 : K * N;
  g.d = out->untyped_data();
  g.ldd = N;
  g.batch_d = M * N;
  g.c = g.d;
  g.ldc = g.ldd;
  g.batch_c = g.batch_d;
  g.beta = 0.0f;
  if (Lb == 1 && L > 1 && !transpose_a) {
    // b is shared and a's rows are contiguous across the batch: one GEMM of L*M rows (the same
    // per-row arithmetic; no broadcast stride for TMA).
    g.m = L * M;
    g.l = 1;
    g.batch_a = g.batch_b = g.batch_c = g.batch_d = 0;
  }
  if (K > chunk) {
    // The workspace bound is jaxdet/_src/matmul/matmul.py's gemm_workspace_bytes.
    const int64_t n = (K + chunk - 1) / chunk;
    const size_t need = static_cast<size_t>(n * L * M * N) * sizeof(float);
    auto base = reinterpret_cast<uintptr_t>(workspace->untyped_data());
    const uintptr_t aligned = (base + 255) & ~uintptr_t{255};
    if (workspace->size_bytes() < need + (aligned - base)) {
      return invalid(op, "the workspace is smaller than the float32 partials of the " + std::to_string(n) +
                             " chunks of K need");
    }
    if (use_sm90(d) && !transpose_a && dt != ffi::F32) {  // Hopper's cooperative tiles: one launch
      const KernelSet set = pick_gemm(d, dt, transpose_a, transpose_b, out_f32);
      if (auto err = check_forced_tile(op, set, d); err.failure()) return err;
      if (const TileKernel* t = choose_chunked_tile(set, d, g.m, g.n, g.l, n); t != nullptr) {
        g.chunk = chunk;
        g.chunk_workspace = reinterpret_cast<void*>(aligned);
        g.chunk_workspace_bytes = workspace->size_bytes() - (aligned - base);
        return launch(op, t->launch, g, stream);
      }
    }
    return chunked_gemm(stream, op, d, g, chunk, transpose_a, transpose_b, dt, odt,
                        reinterpret_cast<float*>(aligned), out->untyped_data());
  }
  const KernelSet set = pick_gemm(d, dt, transpose_a, transpose_b, out_f32);
  if (auto err = check_forced_tile(op, set, d); err.failure()) return err;
  return launch(op, choose_tile(set, d, g.m, g.n, g.l).launch, g, stream);
}

// One weight gradient's operands: a [L, T, K] read in place as A' = a^T (column-major [K, T]) and
// dc [L, T, N] (row-major), reduced over the T tokens chunk by chunk.
struct WgradOperands {
  ffi::DataType dt;
  int64_t L = 0, T = 0, K = 0, N = 0;
  const char* a = nullptr;
  const char* dc = nullptr;
  size_t esize = 0;
};

ffi::Error decode_wgrad(const char* op, ffi::AnyBuffer a, ffi::AnyBuffer dc, ffi::Span<const int64_t> out_dims,
                        int64_t chunk_tokens, WgradOperands* w) {
  const ffi::DataType dt = a.element_type();
  if (dt != ffi::F32 && dt != ffi::BF16 && dt != ffi::F16) {
    return invalid(op, "a must be float32, bfloat16 or float16");
  }
  if (dc.element_type() != dt) return invalid(op, "a and dc must have the same dtype");
  if (chunk_tokens <= 0) return invalid(op, "chunk_tokens must be positive");
  int64_t L, K, N, La, T, Ka, Ld, Td, Nd;
  if (!dims3(out_dims, &L, &K, &N) || !dims3(a.dimensions(), &La, &T, &Ka) ||
      !dims3(dc.dimensions(), &Ld, &Td, &Nd)) {
    return invalid(op, "a, dc and the result must be rank 3");
  }
  if (La != L || Ld != L || Ka != K || Nd != N || Td != T) {
    return invalid(op, "shapes must be a [L,T,K], dc [L,T,N], result (and acc) [L,K,N]");
  }
  if (dt != ffi::F32 && L > 0 && T > 0 && (K % 8 != 0 || N % 8 != 0)) {
    return invalid(op, "bfloat16/float16 operands need K and N to be multiples of 8 elements (K=" +
                           std::to_string(K) + ", N=" + std::to_string(N) + "); pad with zeros");
  }
  w->dt = dt;
  w->L = L;
  w->T = T;
  w->K = K;
  w->N = N;
  w->a = static_cast<const char*>(a.untyped_data());
  w->dc = static_cast<const char*>(dc.untyped_data());
  w->esize = dt == ffi::F32 ? 4 : 2;
  return ffi::Error::Success();
}

bool wgrad_is_empty(const WgradOperands& w) { return w.L == 0 || w.K == 0 || w.N == 0 || w.T == 0; }

// The GEMM of the chunk that starts at token t0: D = A'[:, t0:t0+tc] . dc[t0:t0+tc, :] (+ C when
// beta == 1). C and D are [L, K, N] row-major.
GemmArgs chunk_args(const DeviceInfo& d, const WgradOperands& w, int64_t t0, int64_t chunk_tokens, const void* c,
                    float beta, void* dst) {
  GemmArgs g;
  g.device = d.device;
  g.sm_count = d.sms;
  g.m = w.K;
  g.n = w.N;
  g.k = std::min(chunk_tokens, w.T - t0);
  g.l = w.L;
  g.a = w.a + static_cast<size_t>(t0 * w.K) * w.esize;
  g.lda = w.K;
  g.batch_a = w.T * w.K;
  g.b = w.dc + static_cast<size_t>(t0 * w.N) * w.esize;
  g.ldb = w.N;
  g.batch_b = w.T * w.N;
  g.c = c;
  g.beta = beta;
  g.ldc = w.N;
  g.batch_c = w.K * w.N;
  g.d = dst;
  g.ldd = w.N;
  g.batch_d = w.K * w.N;
  return g;
}

// Chunks with t0 < t_end, in order, into the float32 accumulator `acc` (C = D = acc): each adds its
// partial once; with `fresh`, chunk 0's partial is written as it is (beta = 0: no read, no zero fill).
ffi::Error wgrad_f32_chunks(cudaStream_t stream, const char* op, const DeviceInfo& d, const WgradOperands& w,
                            int64_t chunk_tokens, float* acc, bool fresh, int64_t t_end) {
  const Launcher fn = pick_wgrad(d, w.dt);
  for (int64_t t0 = 0; t0 < t_end; t0 += chunk_tokens) {
    const float beta = (fresh && t0 == 0) ? 0.0f : 1.0f;
    if (auto err = launch(op, fn, chunk_args(d, w, t0, chunk_tokens, acc, beta, acc), stream); err.failure()) {
      return err;
    }
  }
  return ffi::Error::Success();
}

ffi::Error GemmWgradCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> acc, ffi::AnyBuffer a, ffi::AnyBuffer dc,
                         ffi::Result<ffi::Buffer<ffi::F32>> out, int64_t chunk_tokens) {
  constexpr const char* op = "jaxdet_gemm_wgrad";
  const auto ad = acc.dimensions(), od = out->dimensions();
  if (ad.size() != od.size() || !std::equal(ad.begin(), ad.end(), od.begin())) {
    return invalid(op, "acc and the result must have the same shape [L,K,N]");
  }
  WgradOperands w;
  if (auto err = decode_wgrad(op, a, dc, od, chunk_tokens, &w); err.failure()) return err;
  float* dst = out->typed_data();
  if (acc.typed_data() != dst && out->size_bytes() > 0) {
    // The result is meant to alias acc; if XLA handed a separate buffer, start it from acc.
    const cudaError_t e =
        cudaMemcpyAsync(dst, acc.typed_data(), out->size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return cuda_error(op, e);
  }
  if (wgrad_is_empty(w)) return ffi::Error::Success();
  DeviceInfo d;
  if (auto err = check_device(op, &d); err.failure()) return err;
  return wgrad_f32_chunks(stream, op, d, w, chunk_tokens, dst, /*fresh=*/false, w.T);
}

// dB with no accumulator to start from, in the result's dtype: float32 (the accumulator itself) or
// the inputs' bfloat16/float16 (the accumulator cast once, RNE). For a half result the earlier
// chunks accumulate in `workspace` (float32 [L, K, N]; empty when the tokens fit in one chunk) and
// the last chunk's epilogue adds its partial and casts: the same float32 additions, in the same
// order, as the float32 result followed by astype.
ffi::Error GemmWgradInitCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer dc,
                             ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> workspace,
                             int64_t chunk_tokens) {
  constexpr const char* op = "jaxdet_gemm_wgrad_init";
  WgradOperands w;
  if (auto err = decode_wgrad(op, a, dc, out->dimensions(), chunk_tokens, &w); err.failure()) return err;
  const ffi::DataType odt = out->element_type();
  if (odt != ffi::F32 && odt != w.dt) {
    return invalid(op, std::string("the result must be float32 or ") + dtype_name(w.dt));
  }
  if (wgrad_is_empty(w)) {
    if (out->size_bytes() == 0) return ffi::Error::Success();
    const cudaError_t e = cudaMemsetAsync(out->untyped_data(), 0, out->size_bytes(), stream);  // no tokens: 0
    return e == cudaSuccess ? ffi::Error::Success() : cuda_error(op, e);
  }
  DeviceInfo d;
  if (auto err = check_device(op, &d); err.failure()) return err;
  if (odt == ffi::F32) {
    return wgrad_f32_chunks(stream, op, d, w, chunk_tokens, static_cast<float*>(out->untyped_data()),
                            /*fresh=*/true, w.T);
  }
  const bool bf16 = w.dt == ffi::BF16;
  const bool hopper = use_sm90(d);
  const int64_t last = ((w.T - 1) / chunk_tokens) * chunk_tokens;  // first token of the last chunk
  if (last == 0) {  // one chunk: D = partial, cast in the epilogue
    const Launcher fn = hopper ? (bf16 ? gemm::sm90_bf16_tn_bf16_128x256 : gemm::sm90_f16_tn_f16_128x256)
                               : (bf16 ? gemm::sm80_bf16_tn_bf16_128x128 : gemm::sm80_f16_tn_f16_128x128);
    return launch(op, fn, chunk_args(d, w, 0, chunk_tokens, nullptr, 0.0f, out->untyped_data()), stream);
  }
  const int64_t n_out = w.L * w.K * w.N;
  if (static_cast<int64_t>(workspace->element_count()) != n_out) {
    return invalid(op, "the float32 workspace must be [L,K,N] when the tokens span several chunks");
  }
  float* acc = workspace->typed_data();
  if (auto err = wgrad_f32_chunks(stream, op, d, w, chunk_tokens, acc, /*fresh=*/true, last); err.failure()) {
    return err;
  }
  if (hopper) {  // D (half) = C (f32) + partial: the last addition and the cast in one epilogue
    const Launcher fn = bf16 ? gemm::sm90_bf16_tn_f32acc_bf16_128x256 : gemm::sm90_f16_tn_f32acc_f16_128x256;
    return launch(op, fn, chunk_args(d, w, last, chunk_tokens, acc, 1.0f, out->untyped_data()), stream);
  }
  if (auto err = launch(op, pick_wgrad(d, w.dt), chunk_args(d, w, last, chunk_tokens, acc, 1.0f, acc), stream);
      err.failure()) {
    return err;
  }
  // Off Hopper the last chunk's epilogue cannot take a float32 C with a half D: the cast is a
  // tree of one leaf.
  return chunk_tree(stream, op, w.dt, acc, 1, n_out, out->untyped_data());
}

}  // namespace

namespace {

// The kernel set jaxdet_gemm runs for these operands on the current device (for the bindings).
KernelSet kernel_set_for(const std::string& dtype, bool transpose_a, bool transpose_b, bool out_f32,
                         DeviceInfo* d) {
  const ffi::DataType dt = dtype == "float32"    ? ffi::F32
                           : dtype == "bfloat16" ? ffi::BF16
                           : dtype == "float16"  ? ffi::F16
                                                 : ffi::DataType::INVALID;
  if (dt == ffi::DataType::INVALID)
    throw std::invalid_argument("dtype must be float32, bfloat16 or float16, not " + dtype);
  if (auto err = check_device("jaxdet gemm", d); err.failure()) throw std::runtime_error(err.message());
  return pick_gemm(*d, dt, transpose_a, transpose_b, out_f32 && dt != ffi::F32);
}

}  // namespace

std::pair<int, int> gemm_cuda_tile(const std::string& dtype, bool transpose_a, bool transpose_b, bool out_f32,
                                   int64_t m, int64_t n, int64_t l) {
  if (m <= 0 || n <= 0 || l <= 0) throw std::invalid_argument("m, n and l must be positive");
  DeviceInfo d;
  const KernelSet set = kernel_set_for(dtype, transpose_a, transpose_b, out_f32, &d);
  if (auto err = check_forced_tile("jaxdet gemm", set, d); err.failure())
    throw std::invalid_argument(err.message());
  const TileKernel& t = choose_tile(set, d, m, n, l);
  return {t.tile_m, t.tile_n};
}

std::vector<std::pair<int, int>> gemm_cuda_tiles(const std::string& dtype, bool transpose_a, bool transpose_b,
                                                 bool out_f32) {
  DeviceInfo d;
  const KernelSet set = kernel_set_for(dtype, transpose_a, transpose_b, out_f32, &d);
  std::vector<std::pair<int, int>> tiles;
  for (int i = 0; i < set.count; ++i) tiles.emplace_back(set.tiles[i].tile_m, set.tiles[i].tile_n);
  return tiles;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_cuda, GemmCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("transpose_a")
                                  .Attr<bool>("transpose_b")
                                  .Attr<int64_t>("chunk"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_cuda, GemmWgradCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("chunk_tokens"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxdet_gemm_wgrad_init_cuda, GemmWgradInitCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("chunk_tokens"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxdet
