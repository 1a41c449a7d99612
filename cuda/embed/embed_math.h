// The canonical chunk tree of a segment sum, compiled for both host (CPU handler) and device (CUDA
// kernel), so both backends do the same float32 additions in the same order (docs/embed.md).
//
// A segment's tokens arrive in ascending token index t; chunk c = t / chunk_tokens. Each non-empty
// chunk's partial is its tokens folded in order from +0 (acc = acc + x, no FMA). The chunk partials
// are combined by the canonical tree (jaxdet.parallel.tree_sum's: balanced binary tree over the
// chunk index, lower index first, padded with absent leaves). An empty chunk's partial is +0, and
// no partial or tree node is ever -0 (a fold from +0 and sums of such values give -0 only from two
// -0 operands), so adding an empty chunk is exact: x + (+0) = x. The tree over the chunks that
// hold tokens, keeping their absolute positions, therefore has the bits of the full padded tree.
#pragma once

#include <cstdint>

#include "common/det_math.h"  // detmath::add (never contracted), JAXDET_HD

namespace jaxdet {
namespace embed {

// Chunk indices below 2^kMaxChunkBits (the handlers check it: 2^31 tokens in chunks of 8192 need
// 18 bits) keep the tree within kMaxChunkBits levels, and the neighbouring entries' common
// ancestors are at distinct levels, so the stack holds at most kMaxChunkBits + 1 entries (720 bytes
// of a CUDA thread's local memory for eight columns).
constexpr int kMaxChunkBits = 19;
constexpr int kMaxDepth = kMaxChunkBits + 1;

// The level of the lowest common ancestor of leaves a != b (a node at level k spans 2^k leaves).
JAXDET_HD int common_level(int32_t a, int32_t b) {
  const uint32_t x = static_cast<uint32_t>(a ^ b);
#if defined(__CUDA_ARCH__)
  return 32 - __clz(static_cast<int>(x));
#else
  return 32 - __builtin_clz(x);
#endif
}

// A stack of complete subtrees over the present leaves, walked left to right (a binary counter
// that skips absent leaves). Entry i holds the root value of a node and one leaf inside it;
// entries are disjoint and ordered, and the lowest common ancestors of neighbouring entries are
// strictly nested (the top pair's is the smallest), each containing the last leaf pushed.
// push(c) first merges the top pair while their common ancestor cannot receive leaf c (it is
// complete: value = left + right, the other leaves below it being absent or zero); root() joins
// what is left right to left (the right spine of the tree). Every thread of a CUDA warp walks
// the same leaves, so the bookkeeping is uniform and only the values differ per column.
template <int kCols>
struct ChunkTree {
  float value[kMaxDepth][kCols];
  int32_t leaf[kMaxDepth];
  int top = 0;

  JAXDET_HD void push(int32_t chunk, const float (&partial)[kCols]) {
    while (top >= 2) {
      const int level = common_level(leaf[top - 2], leaf[top - 1]);
      if ((chunk >> level) == (leaf[top - 2] >> level)) break;  // the node may still receive leaves
#pragma unroll
      for (int j = 0; j < kCols; ++j) value[top - 2][j] = detmath::add(value[top - 2][j], value[top - 1][j]);
      --top;
    }
#pragma unroll
    for (int j = 0; j < kCols; ++j) value[top][j] = partial[j];
    leaf[top] = chunk;
    ++top;
  }

  // The tree's root; the stack must hold at least one entry.
  JAXDET_HD void root(float (&out)[kCols]) const {
#pragma unroll
    for (int j = 0; j < kCols; ++j) out[j] = value[top - 1][j];
    for (int i = top - 2; i >= 0; --i) {
#pragma unroll
      for (int j = 0; j < kCols; ++j) out[j] = detmath::add(value[i][j], out[j]);
    }
  }
};

}  // namespace embed
}  // namespace jaxdet
