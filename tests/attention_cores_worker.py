"""Runs jaxdet.attention's GPU forward (and the backward on its outputs) over fixed inputs with special
values, for tests/test_attention.py's comparison of the tensor-core kernels: on a Hopper GPU the
final-mode forward and the backward issue wgmma (WgmmaCore), the forward in warp-specialized CTAs
(FwdWsKernel); JAXDET_TESTING (read once per process, hence this subprocess) makes the forward run
one-warpgroup CTAs (attention=wgmma) or everything issue mma.sync (attention=mma, MmaSyncCore),
as every other GPU does. The split mode of a small grid at head dimension 128 (decode steps) runs
eight warps per split (DecodeSplitKernel), merged in clusters unless attention=split_combine makes
CombineKernel merge them, or FwdKernel's one-warp CTAs under attention=one_warp_splits; under
attention=eight_warp_splits DecodeSplitKernel runs larger grids too.

    python attention_cores_worker.py OUT.npz    # every case's o, dq, dk, dv -> OUT.npz
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from special_values import sprinkle_special

import jaxdet

# (B, T, query heads, KV heads): grouped heads; rows that end inside a block; a length past one
# split (512 keys) that still runs the final mode on an H100 (enough tiles), so splits merge in the
# kernel.
SHAPES = [(2, 300, 8, 2), (3, 257, 4, 4), (2, 1100, 16, 4)]
# Split mode, (B, T, S, query heads, KV heads): decode steps past one and several splits, a chunk
# of 4 queries (16 rows), decode steps within one split (a grid of a few CTAs, each a cluster of
# one, and one of more CTAs than SMs), and packed sequences of 600 tokens (38 row tiles x 2 splits:
# a CTA's rows run in several passes).
DECODE_SHAPES = [(1, 1, 1100, 8, 2), (3, 1, 2000, 32, 8), (2, 4, 1500, 16, 4), (2, 1, 300, 8, 2), (40, 1, 300, 16, 4)]
PACKED_SPLIT_SHAPE = (1, 600, 600, 1, 1)


def cases():
    """(name, q, k, v, do, keyword arguments) for every case, the same in every process."""
    for dtype in (jnp.bfloat16, jnp.float16):
        for D in (64, 128):  # the head dimensions the wgmma forward runs (docs/attention.md)
            for B, T, N, K in SHAPES:
                rng = np.random.default_rng(B * 1000 + T + D)
                shapes = [(B, T, N, D), (B, T, K, D), (B, T, K, D), (B, T, N, D)]
                q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in shapes)
                segments = np.repeat([0, 1, 2], [T // 3, 1, T - T // 3 - 1])[None].repeat(B, 0)
                variants = {
                    "causal": ((q, k, v), {}),
                    "special": (
                        (
                            sprinkle_special(q, rng, dtype),
                            sprinkle_special(k, rng, dtype),
                            sprinkle_special(v, rng, dtype),
                        ),
                        {},
                    ),
                    "kv_lengths": ((q, k, v), dict(causal=False, kv_lengths=jnp.asarray([T // 3] + [T] * (B - 1)))),
                    "segments": ((q, k, v), dict(segment_ids=jnp.asarray(segments))),
                }
                for variant, (qkv, kw) in variants.items():
                    name = f"{jnp.dtype(dtype).name}_D{D}_B{B}_T{T}_N{N}_K{K}_{variant}"
                    yield name, *(jnp.asarray(x, dtype) for x in (*qkv, do)), kw
            for B, T, S, N, K in [*DECODE_SHAPES, PACKED_SPLIT_SHAPE]:
                rng = np.random.default_rng(B * 1000 + T + S + D)
                shapes = [(B, T, N, D), (B, S, K, D), (B, S, K, D), (B, T, N, D)]
                q, k, v, do = (rng.standard_normal(s).astype(np.float32) for s in shapes)
                special = tuple(sprinkle_special(x, rng, dtype) for x in (q, k, v))
                if T == S:
                    segments = jnp.asarray(np.repeat([0, 1, 2], [150, 449, 1])[None].repeat(B, 0))
                    variants = {
                        "segments": ((q, k, v), dict(segment_ids=segments)),
                        "special_segments": (special, dict(segment_ids=segments)),
                    }
                else:
                    positions = dict(q_positions=jnp.asarray(S - T + np.arange(T)))
                    shorter = dict(positions, kv_lengths=jnp.asarray([S // 2 + 7 * b for b in range(B)]))
                    variants = {
                        "decode": ((q, k, v), positions),
                        "special_decode": (special, positions),
                        "kv_lengths": ((q, k, v), shorter),
                    }
                for variant, (qkv, kw) in variants.items():
                    name = f"{jnp.dtype(dtype).name}_D{D}_B{B}_T{T}_S{S}_N{N}_K{K}_{variant}"
                    yield name, *(jnp.asarray(x, dtype) for x in (*qkv, do)), kw


def main(path):
    gpu = jax.devices("gpu")[0]
    out = {}
    for name, q, k, v, do, kw in cases():
        q, k, v, do = (jax.device_put(x, gpu) for x in (q, k, v, do))
        o, vjp = jax.vjp(lambda q, k, v, kw=kw: jaxdet.attention(q, k, v, **kw), q, k, v)
        dq, dk, dv = vjp(do)
        for part, x in zip(("o", "dq", "dk", "dv"), (o, dq, dk, dv)):
            out[f"{name}/{part}"] = np.asarray(jax.device_get(x))
    np.savez(path, **out)
    print(f"{len(out)} arrays")


if __name__ == "__main__":
    main(sys.argv[1])
