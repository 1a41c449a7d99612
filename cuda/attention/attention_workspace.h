// The device memory the CUDA handlers of jaxdet.attention work in besides their operands and
// results. XLA allocates it as the custom call's last result, a byte buffer the lowering sizes with
// these functions (through jaxdet._native): a handler that takes nothing from XLA's scratch
// allocator can be recorded into a command buffer (a CUDA graph), whose replays keep the addresses
// the recording saw, so XLA launches a decode step's kernels with their neighbours' as one graph.
//
// Everything here depends on the shapes only, never on the device: the lowering and the handler
// compute the same layout.
#pragma once

#include <cstddef>
#include <cstdint>

#include "attention/attention_math.h"

namespace jaxdet {
namespace attn {

constexpr size_t kWorkspaceAlign = 256;

inline size_t workspace_align(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

// The forward runs in split mode (each CTA one split of kSplit positions of 16 query rows, the
// splits merged after them) when the final mode's CTAs of 64 rows (16 at head dimension 256) would
// be mostly empty or too few: at most 16 query rows per (b, h) (a decode step, even with one split:
// 16-row CTAs of the split kernels rather than 64-row tiles holding a row or two), or, with more
// than one split, fewer final tiles than two waves of an H100 (132 SMs). The choice never changes a
// bit (attention_cuda.cu); it is fixed by the shapes so that the workspace is too.
constexpr int64_t kSplitModeBelowTiles = 2 * 132;

struct ForwardWorkspace {
  int64_t nsplit = 0;   // splits per row in split mode; 0: final mode
  int64_t flags = 0;    // an int per CTA of the first launch (attention_nonfinite.cuh), at most
                        // one per 16 query rows and split
  size_t acc_offset = 0;  // split mode: float [B, H, nsplit, R, D]
  size_t ml_offset = 0;   // split mode: float2 [B, H, nsplit, R], each split's (m, l)
  size_t bytes = 0;
};

// tensor_cores: bfloat16 or float16 (the float32 kernels need no workspace).
inline ForwardWorkspace forward_workspace(int64_t B, int64_t T, int64_t H, int64_t G, int64_t D, int64_t S,
                                          bool tensor_cores) {
  ForwardWorkspace w;
  const int64_t R = T * G;
  if (!tensor_cores || B * H * R == 0) return w;
  const int64_t splits = (S + kSplit - 1) / kSplit;
  const int64_t final_rows = D <= 128 ? 64 : 16;  // the smallest final-mode CTA's rows at this D
  const int64_t final_tiles = (R + final_rows - 1) / final_rows;
  const bool split = R <= 16 || (splits > 1 && B * H * final_tiles < kSplitModeBelowTiles);
  w.nsplit = split ? splits : 0;
  w.flags = (R + 15) / 16 * H * B * (split ? splits : 1);
  size_t at = workspace_align(static_cast<size_t>(w.flags) * sizeof(int));
  if (split) {
    const size_t rows = static_cast<size_t>(B * H * splits * R);
    w.acc_offset = at;
    at += workspace_align(rows * static_cast<size_t>(D) * sizeof(float));
    w.ml_offset = at;
    at += workspace_align(rows * 2 * sizeof(float));
  }
  w.bytes = at;
  return w;
}

struct BackwardWorkspace {
  int64_t query_tiles = 0;  // ceil(R / 64)
  size_t ranges_offset = 0;  // tensor cores: int2 [B, query_tiles] (TileRangeKernel)
  size_t flags_offset = 0;   // tensor cores: an int per dQ CTA (ceil(R / 16) H B), then per dK/dV CTA
  size_t bytes = 0;          // from offset 0: delta, float [B, H, T, G]
};

inline BackwardWorkspace backward_workspace(int64_t B, int64_t T, int64_t H, int64_t G, int64_t D, int64_t S,
                                            bool tensor_cores) {
  (void)D;
  BackwardWorkspace w;
  const int64_t R = T * G;
  size_t at = workspace_align(static_cast<size_t>(B * H * R) * sizeof(float));
  w.query_tiles = (R + 63) / 64;
  if (tensor_cores && B * w.query_tiles > 0) {
    w.ranges_offset = at;
    at += workspace_align(static_cast<size_t>(B * w.query_tiles) * 2 * sizeof(int));
    w.flags_offset = at;
    at += workspace_align(static_cast<size_t>(((R + 15) / 16 + (S + 63) / 64) * H * B) * sizeof(int));
  }
  w.bytes = at;
  return w;
}

}  // namespace attn
}  // namespace jaxdet
