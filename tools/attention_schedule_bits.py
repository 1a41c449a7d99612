"""Hashes of attention results, to show that a change of the kernels' schedule leaves every bit.

    python tools/attention_schedule_bits.py > before.txt     # with the old build
    python tools/attention_schedule_bits.py > after.txt      # with the new one
    diff before.txt after.txt                                     # empty: the same bits

Runs `jaxdet.attention` forward and backward (output, dQ, dK, dV) in bfloat16 and float16 at head
dimensions 64, 128 and 256 on fixed random inputs: causal, with kv_lengths (non-causal), with
packed segments, a decode step against a cache longer than one split (the GPU's split mode and
combine), and the training shape (2 x 2048, 32 query / 8 KV heads, d 128); one SHA-1 prefix per
configuration. On a GPU it is `tools/gpu_session.sh attention-bits`.
"""

from __future__ import annotations

import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet

# (B, T, query heads, KV heads); head dimension 256 only at the small shapes
SHAPES = [(2, 70, 4, 2), (1, 300, 8, 2), (2, 1030, 4, 4)]


def rand(key, shape, dtype):
    """The inputs of benchmarks/attention_bench.py (the same bits for the same key)."""
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def sha(*xs):
    m = hashlib.sha1()
    for x in xs:
        m.update(np.asarray(jax.device_get(x)).view(np.uint8).tobytes())
    return m.hexdigest()[:16]


def with_grads(q, k, v, do, **kw):
    o, vjp = jax.vjp(lambda q, k, v: jaxdet.attention(q, k, v, **kw), q, k, v)
    dq, dk, dv = vjp(do)
    return f"o {sha(o)} dq {sha(dq)} dk {sha(dk)} dv {sha(dv)}"


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    for dtype in (jnp.bfloat16, jnp.float16):
        name = jnp.dtype(dtype).name
        for D in (64, 128, 256):
            for B, T, N, K in SHAPES:
                if D == 256 and T > 400:
                    continue
                q, k, v = rand(0, (B, T, N, D), dtype), rand(1, (B, T, K, D), dtype), rand(2, (B, T, K, D), dtype)
                do = rand(3, (B, T, N, D), dtype)
                segments = np.repeat([0, 1, 2], [T // 3, 1, T - T // 3 - 1])[None].repeat(B, 0)
                cases = {
                    "causal": {},
                    "kv_lengths": dict(causal=False, kv_lengths=jnp.asarray([T // 3] + [T] * (B - 1))),
                    "segments": dict(segment_ids=jnp.asarray(segments)),
                }
                for case, kw in cases.items():
                    print(f"{name} D{D} {B}x{T}x{N}/{K} {case}: {with_grads(q, k, v, do, **kw)}")
            B, T, N, K = SHAPES[0]
            q = rand(0, (B, 1, N, D), dtype)
            kc, vc = rand(4, (B, 1100, K, D), dtype), rand(5, (B, 1100, K, D), dtype)
            o = jaxdet.attention(
                q, kc, vc, q_positions=jnp.asarray([[1000], [600]]), kv_lengths=jnp.asarray([1001, 1100])
            )
            print(f"{name} D{D} decode: o {sha(o)}")
    B, T, N, K, D = 2, 2048, 32, 8, 128
    q, k, v = (
        rand(0, (B, T, N, D), jnp.bfloat16),
        rand(1, (B, T, K, D), jnp.bfloat16),
        rand(2, (B, T, K, D), jnp.bfloat16),
    )
    print(f"bfloat16 D{D} {B}x{T}x{N}/{K} causal: {with_grads(q, k, v, rand(3, (B, T, N, D), jnp.bfloat16))}")


if __name__ == "__main__":
    main()
