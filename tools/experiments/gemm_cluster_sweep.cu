// Hopper GEMM variants that may join a kernel set, timed side by side in one process on the
// problems where the bucketed sets fall short of jnp.dot, with the bits of every variant compared
// against the set's current tile (a variant changes which CTA computes a tile and how its operands
// reach shared memory, never the K steps, so the bits must be equal):
//   dA (nt) at 128-256 rows with a long reduction: 64-row ping-pong tiles in thread block clusters
//     of 2 along M (B multicast by TMA), 2 along N (A multicast) or 2x2, against the same tile alone;
//   the weight gradient (tn) of a few tokens: 64-row ping-pong tiles against the 128x256
//     cooperative tile (the output, not the math, bounds it there);
//   ("rows: ...") the forward and dA of 4096-wide outputs at three and four rows of 64-row tiles
//     (M = 160 ... 256): the sets' tiles against a 128x128 cooperative one.
// The set's choice against jnp.dot: benchmarks/matmul_bench.py.
//
// Build (five units, so they compile in parallel) and run on a Hopper GPU
// (tools/gpu_session.sh cluster-sweep; arguments: rounds, and a prefix of the problems to run):
//   for p in 0 1 2 3 4; do nvcc -std=c++17 -O3 -DNDEBUG --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a \
//     -I cuda -I <cutlass>/include -DSWEEP_PART=$p -c tools/experiments/gemm_cluster_sweep.cu -o sweep$p.o & done; wait
//   nvcc -std=c++17 -O3 ... -c tools/experiments/gemm_cluster_sweep.cu -o sweep_main.o && nvcc sweep*.o -o sweep && ./sweep
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gemm/gemm_args.h"

namespace jaxdet {
namespace gemm {
namespace sweep {

enum Op { kDA, kWgrad, kFwd };

// One variant: layout of the op, tile, cluster. Defined in the part that instantiates it.
template <Op op, int TileM, int TileN, int ClusterM, int ClusterN>
Status run_variant(const GemmArgs& g, cudaStream_t stream);

}  // namespace sweep
}  // namespace gemm
}  // namespace jaxdet

#ifdef SWEEP_PART
#include "gemm/gemm_sm90.cuh"

namespace jaxdet {
namespace gemm {
namespace sweep {

using Element = cutlass::bfloat16_t;
using Row = cutlass::layout::RowMajor;
using Col = cutlass::layout::ColumnMajor;

template <Op op, int TileM, int TileN, int ClusterM, int ClusterN>
Status run_variant(const GemmArgs& g, cudaStream_t stream) {
  using LayoutA = std::conditional_t<op == kWgrad, Col, Row>;
  using LayoutB = std::conditional_t<op == kDA, Col, Row>;
  return sm90::run<sm90::Config<Element, LayoutA, LayoutB, void, Element, TileM, TileN, Row, ClusterM, ClusterN>>(
      g, stream);
}

// The variants of each part, (op, tile rows, tile columns, cluster along M, cluster along N).
#define SWEEP_PART_0(X) X(kDA, 64, 64, 1, 1) X(kDA, 64, 64, 2, 1) X(kDA, 64, 64, 1, 2) X(kDA, 64, 64, 2, 2)
#define SWEEP_PART_1(X) X(kDA, 64, 128, 1, 1) X(kDA, 64, 128, 2, 1) X(kDA, 64, 128, 1, 2) X(kDA, 64, 128, 2, 2)
#define SWEEP_PART_2(X) \
  X(kDA, 64, 256, 1, 1) X(kDA, 64, 256, 2, 1) X(kDA, 64, 256, 1, 2) X(kDA, 128, 256, 1, 1) X(kDA, 128, 128, 1, 1)
#define SWEEP_PART_3(X) \
  X(kWgrad, 128, 256, 1, 1) X(kWgrad, 128, 128, 1, 1) X(kWgrad, 64, 256, 1, 1) X(kWgrad, 64, 128, 1, 1)
#define SWEEP_PART_4(X) X(kFwd, 64, 128, 1, 1) X(kFwd, 64, 256, 1, 1) X(kFwd, 128, 128, 1, 1) X(kFwd, 128, 256, 1, 1)
#define SWEEP_INSTANTIATE(op, tm, tn, cm, cn) template Status run_variant<op, tm, tn, cm, cn>(const GemmArgs&, cudaStream_t);
#define SWEEP_CAT(a, b) a##b
#define SWEEP_PART_OF(p) SWEEP_CAT(SWEEP_PART_, p)
SWEEP_PART_OF(SWEEP_PART)(SWEEP_INSTANTIATE)

}  // namespace sweep
}  // namespace gemm
}  // namespace jaxdet

#else  // the driver
#include "cuda_check.h"

namespace sweep = jaxdet::gemm::sweep;
using jaxdet::gemm::GemmArgs;
using jaxdet::gemm::Launcher;

struct Variant {
  const char* name;
  Launcher fn;
};

#define V(op, tm, tn, cm, cn) \
  Variant { #tm "x" #tn " cluster " #cm "x" #cn, &sweep::run_variant<sweep::op, tm, tn, cm, cn> }

// The first variant of each list is the reference of the bits column.
const std::vector<Variant> kDA64 = {V(kDA, 64, 64, 1, 1), V(kDA, 64, 64, 2, 1), V(kDA, 64, 64, 1, 2),
                                    V(kDA, 64, 64, 2, 2), V(kDA, 64, 128, 1, 1), V(kDA, 64, 128, 2, 1),
                                    V(kDA, 64, 128, 1, 2), V(kDA, 64, 128, 2, 2), V(kDA, 64, 256, 1, 2)};
const std::vector<Variant> kDA128 = {V(kDA, 64, 128, 1, 1), V(kDA, 64, 128, 2, 1), V(kDA, 64, 128, 1, 2),
                                     V(kDA, 64, 128, 2, 2), V(kDA, 64, 64, 1, 1),  V(kDA, 64, 64, 2, 1),
                                     V(kDA, 64, 64, 1, 2),  V(kDA, 64, 64, 2, 2),  V(kDA, 64, 256, 1, 1),
                                     V(kDA, 64, 256, 2, 1), V(kDA, 64, 256, 1, 2), V(kDA, 128, 256, 1, 1),
                                     V(kDA, 128, 128, 1, 1)};
const std::vector<Variant> kFwdRows = {V(kFwd, 64, 128, 1, 1), V(kFwd, 64, 256, 1, 1), V(kFwd, 128, 128, 1, 1),
                                       V(kFwd, 128, 256, 1, 1)};
const std::vector<Variant> kWgrad = {V(kWgrad, 128, 256, 1, 1), V(kWgrad, 128, 128, 1, 1), V(kWgrad, 64, 256, 1, 1),
                                     V(kWgrad, 64, 128, 1, 1)};

__global__ void fill(uint16_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    // bf16 in [-1, 1): sign, exponent 120..126, any mantissa.
    p[i] = static_cast<uint16_t>(((h >> 31) << 15) | ((120u + (h >> 8) % 7u) << 7) | (h & 0x7Fu));
  }
}

uint16_t* alloc_filled(size_t n, uint32_t seed) {
  uint16_t* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * 2));
  fill<<<1024, 256>>>(p, n, seed);
  CHECK(cudaGetLastError());
  return p;
}

struct Problem {
  std::string what;
  sweep::Op op;
  int64_t m, n, k;  // the GEMM's M, N, K (dA: M tokens, N = the layer's input width, K = its output width)
};

// Operands and outputs, in copies that together exceed L2 (each launch reads and writes memory).
struct Operands {
  std::vector<GemmArgs> gs;
  std::vector<void*> bufs;
  ~Operands() {
    for (void* p : bufs) cudaFree(p);
  }
};

void make_operands(const Problem& p, int sms, Operands* o) {
  const size_t a_elems = p.m * p.k, b_elems = p.k * p.n;
  const size_t big = std::max({a_elems, b_elems, size_t(p.m * p.n)}) * 2;
  const int copies = static_cast<int>(std::min<size_t>(4, 1 + (120u << 20) / big));
  for (int c = 0; c < copies; ++c) {
    void* d = nullptr;
    CHECK(cudaMalloc(&d, p.m * p.n * 2));
    o->bufs.push_back(d);
    uint16_t* a = alloc_filled(a_elems, 17u + c);
    uint16_t* b = alloc_filled(b_elems, 91u + c);
    o->bufs.push_back(a);
    o->bufs.push_back(b);
    GemmArgs g;
    g.device = 0;
    g.sm_count = sms;
    g.m = p.m;
    g.n = p.n;
    g.k = p.k;
    g.l = 1;
    g.a = a;
    g.b = b;
    if (p.op == sweep::kFwd) {  // A row-major [M, K]; B row-major [K, N]
      g.lda = p.k;
      g.ldb = p.n;
    } else if (p.op == sweep::kDA) {  // A row-major [M, K]; B stored [N, K] (the weight), read transposed
      g.lda = p.k;
      g.ldb = p.k;
    } else {  // A stored [K, M] (the activations, tokens first), read transposed; B row-major [K, N]
      g.lda = p.m;
      g.ldb = p.n;
    }
    g.c = d;
    g.ldc = p.n;
    g.d = d;
    g.ldd = p.n;
    o->gs.push_back(g);
  }
}

float time_us(Launcher fn, const Operands& o, int reps) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) {
    const std::string s = fn(o.gs[i % o.gs.size()], nullptr);
    if (!s.empty()) {
      std::printf("launch failed: %s\n", s.c_str());
      std::exit(1);
    }
  }
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return 1000.0f * ms / reps;
}

std::vector<uint16_t> bits_of(const Launcher fn, const Operands& o) {
  const GemmArgs& g = o.gs[0];
  CHECK(cudaMemset(g.d, 0xFF, g.m * g.n * 2));
  const std::string s = fn(g, nullptr);
  if (!s.empty()) {
    std::printf("launch failed: %s\n", s.c_str());
    std::exit(1);
  }
  std::vector<uint16_t> h(g.m * g.n);
  CHECK(cudaMemcpy(h.data(), g.d, h.size() * 2, cudaMemcpyDeviceToHost));
  return h;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const std::string only = argc > 2 ? argv[2] : "";  // problems whose name starts with this (dA, dB, rows)
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs; median over %d alternating rounds; bits: elements differing from the first variant\n\n",
              prop.name, prop.multiProcessorCount, rounds);
  std::vector<std::pair<Problem, const std::vector<Variant>*>> problems = {
      {{"dA 4096x128256 M=128", sweep::kDA, 128, 4096, 128256}, &kDA64},
      {{"dA 4096x128256 M=256", sweep::kDA, 256, 4096, 128256}, &kDA128},
      {{"dA 4096x14336 M=256", sweep::kDA, 256, 4096, 14336}, &kDA128},
      {{"dA 4096x14336 M=128", sweep::kDA, 128, 4096, 14336}, &kDA64},
      {{"dA 4096x14336 M=64", sweep::kDA, 64, 4096, 14336}, &kDA64},
      {{"dA 4096x14336 M=32", sweep::kDA, 32, 4096, 14336}, &kDA64},
      {{"dA 4096x4096 M=32", sweep::kDA, 32, 4096, 4096}, &kDA64},
      {{"dA 14336x4096 M=256", sweep::kDA, 256, 14336, 4096}, &kDA128},
  };
  // Three and four rows of 64-row tiles (M = 160 ... 256), 4096-wide outputs.
  for (int64_t m : {160, 192, 224, 256}) {
    const std::string at = " M=" + std::to_string(m);
    problems.push_back({{"rows: fwd 14336x4096" + at, sweep::kFwd, m, 4096, 14336}, &kFwdRows});
    problems.push_back({{"rows: fwd 4096x4096" + at, sweep::kFwd, m, 4096, 4096}, &kFwdRows});
    problems.push_back({{"rows: dA 4096x14336" + at, sweep::kDA, m, 4096, 14336}, &kDA128});
    problems.push_back({{"rows: dA 4096x128256" + at, sweep::kDA, m, 4096, 128256}, &kDA128});
  }
  for (int64_t t : {1, 2, 4, 8, 16, 32, 64, 256}) {
    for (auto [kw, nw] : {std::pair<int64_t, int64_t>{4096, 4096}, {4096, 14336}, {14336, 4096}, {4096, 128256}}) {
      const std::string what = "dB " + std::to_string(kw) + "x" + std::to_string(nw) + " tokens=" + std::to_string(t);
      problems.push_back({{what, sweep::kWgrad, kw, nw, t}, &kWgrad});
    }
  }

  for (const auto& [p, variants] : problems) {
    if (p.what.rfind(only, 0) != 0) continue;
    Operands o;
    make_operands(p, prop.multiProcessorCount, &o);
    CHECK(cudaDeviceSynchronize());
    const double bytes = 2.0 * (p.m * p.k + p.k * p.n + p.m * p.n);
    const int reps = std::max<int>(3, std::min<int64_t>(200, int64_t(2e9 / bytes)));
    std::vector<std::vector<float>> us(variants->size());
    for (const Variant& v : *variants) time_us(v.fn, o, 2);  // warm-up (and the smem attribute)
    for (int r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < variants->size(); ++i) us[i].push_back(time_us((*variants)[i].fn, o, reps));
    }
    const std::vector<uint16_t> ref = bits_of((*variants)[0].fn, o);
    std::printf("## %s (M=%lld N=%lld K=%lld)\n\n| variant | us (median) | vs first | HBM TB/s | bits |\n|---|---|---|---|---|\n",
                p.what.c_str(), (long long)p.m, (long long)p.n, (long long)p.k);
    float first = 0;
    for (size_t i = 0; i < variants->size(); ++i) {
      std::sort(us[i].begin(), us[i].end());
      const float med = us[i][us[i].size() / 2];
      if (i == 0) first = med;
      const std::vector<uint16_t> got = bits_of((*variants)[i].fn, o);
      size_t diff = 0;
      for (size_t j = 0; j < ref.size(); ++j) diff += got[j] != ref[j];
      std::printf("| %s | %.1f | %.3f | %.2f | %zu |\n", (*variants)[i].name, med, first / med, bytes / med / 1e6,
                  diff);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}

#endif
