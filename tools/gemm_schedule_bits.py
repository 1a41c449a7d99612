"""Hashes of GEMM results, to show that a change of the kernels' schedule or build leaves every bit.

    python tools/gemm_schedule_bits.py > before.txt     # with the old build
    python tools/gemm_schedule_bits.py > after.txt      # with the new one
    diff before.txt after.txt                                # empty: the same bits

Runs the forward, dA and dB of `jaxdet.matmul` (bfloat16) on fixed random inputs whose tile grids
are taller than wide and wider than tall (the Hopper scheduler's raster order differs between
them), and with few rows and a long reduction, and prints one SHA-256 per result. On a GPU it is
`tools/gpu_session.sh gemm-bits`.
"""

from __future__ import annotations

import argparse
import hashlib

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet

# (K, N, M): tile grids taller than wide and wider than tall, and small M with a long reduction
SHAPES = [(4096, 128256, 2048), (4096, 4096, 8192), (14336, 4096, 1000), (14336, 4096, 40), (4096, 128256, 16)]


def sha(x):
    return hashlib.sha256(np.asarray(x).view(np.uint16).tobytes()).hexdigest()[:16]


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    key = jax.random.PRNGKey(7)
    for K, N, M in SHAPES:
        key, ka, kb, kc = jax.random.split(key, 4)
        a = jax.random.normal(ka, (M, K), jnp.float32).astype(jnp.bfloat16)
        b = jax.random.normal(kb, (K, N), jnp.float32).astype(jnp.bfloat16)
        dc = jax.random.normal(kc, (M, N), jnp.float32).astype(jnp.bfloat16)
        out, vjp = jax.vjp(jaxdet.matmul, a, b)
        da, db = vjp(dc)
        for name, x in (("fwd", out), ("dA", da), ("dB", db)):
            print(f"{name} K={K} N={N} M={M} {sha(x)}", flush=True)


if __name__ == "__main__":
    main()
