"""Runs jaxdet.attention's GPU forward (and the backward on its outputs) over fixed inputs with special
values, for tests/test_attention.py's comparison of the tensor-core kernels: on a Hopper GPU the
final-mode forward and the backward issue wgmma (WgmmaCore), the forward in warp-specialized CTAs
(FwdWsKernel); JAXDET_TESTING (read once per process, hence this subprocess) makes the forward run
one-warpgroup CTAs (attention=wgmma) or everything issue mma.sync (attention=mma, MmaSyncCore),
as every other GPU does.

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
