"""The segment sum's rule in NumPy (docs/embed.md): the reference the kernels are tested against.

For a segment v, the tokens t with ids[t] == v (t: the row-major token index) are cut into chunks of
``chunk_tokens`` by absolute index (chunk t // chunk_tokens). Each chunk folds its tokens in
ascending t in float32 from +0 (``acc = acc + x[t]``, one IEEE add each); the chunk partials (an
empty chunk's is +0) are combined by the canonical tree over the chunk index (balanced, lower index
first, padded to a power of two with absent leaves: ``jaxdet.parallel.tree_sum``'s), in float32;
the root is cast once (round to nearest even) to the output dtype, a NaN as the canonical quiet NaN.
"""

from __future__ import annotations

import numpy as np

from jaxdet._src.embed.embed import CHUNK_TOKENS

# The bits of jnp.nan in each dtype: what the kernels store for a NaN result.
_CANONICAL_NAN = {2: np.uint16, 4: np.uint32}
_NAN_BITS = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}


def tree_sum(parts):
    """The canonical tree of a non-empty list of float32 arrays: pairs of neighbours level by level,
    an odd last one carried up unchanged (its sibling is absent)."""
    parts = list(parts)
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def chunk_partials(data, ids, num_segments, chunk_tokens=CHUNK_TOKENS):
    """The float32 partials [chunks, V, D] of every chunk (+0 for a segment with no token there).

    data [T, D] (any float dtype, widened exactly), ids [T] (ids outside [0, V) contribute nothing).
    Within a chunk, step r adds every segment's r-th token (in ascending t) to its accumulator, so
    each accumulator sees its tokens one at a time in order, with float32 NumPy adds.
    """
    x = np.asarray(data).astype(np.float32)
    ids = np.asarray(ids).reshape(-1).astype(np.int64)
    T, D = x.shape
    chunks = max(1, -(-T // chunk_tokens))
    out = np.zeros((chunks, num_segments, D), np.float32)
    for c in range(chunks):
        lo, hi = c * chunk_tokens, min(T, (c + 1) * chunk_tokens)
        t = np.arange(lo, hi)
        seg = ids[lo:hi]
        keep = (seg >= 0) & (seg < num_segments)
        t, seg = t[keep], seg[keep]
        order = np.argsort(seg, kind="stable")  # by segment, ascending t within each
        t, seg = t[order], seg[order]
        starts = np.searchsorted(seg, seg, side="left")
        rank = np.arange(len(seg)) - starts  # the position of each token within its segment
        acc = out[c]
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN as IEEE says
            for r in range(int(rank.max(initial=-1)) + 1):
                at = rank == r  # at most one token per segment
                acc[seg[at]] = acc[seg[at]] + x[t[at]]
    return out


def segment_sum(data, ids, num_segments, out_dtype=None, chunk_tokens=CHUNK_TOKENS):
    """The rule: data [T, D], ids [T] -> [V, D] of out_dtype (default: data's dtype)."""
    data = np.asarray(data)
    out_dtype = np.dtype(data.dtype if out_dtype is None else out_dtype)
    with np.errstate(over="ignore", invalid="ignore"):
        root = tree_sum(list(chunk_partials(data, ids, num_segments, chunk_tokens)))
        out = root.astype(out_dtype)
    nan = np.array(_NAN_BITS[out_dtype.name], _CANONICAL_NAN[out_dtype.itemsize]).view(out_dtype)
    return np.where(np.isnan(out), nan, out)
