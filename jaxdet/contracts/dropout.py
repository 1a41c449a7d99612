"""Determinism facts about Philox and dropout, measured on the current default device for
`jaxdet report`. Each check returns (ok, detail); ok is None when it cannot be measured here."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet
from jaxdet import random as jr
from jaxdet.testing import bits as _bits

_KAT = [  # Random123 tests/kat_vectors, philox4x32 10 rounds
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def _x(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def check_kat():
    got = [np.asarray(jr.philox4x32_10(np.array(c, np.uint32), np.array(k, np.uint32))).tolist() for c, k, _ in _KAT]
    ok = all(g == list(e) for g, (_, _, e) in zip(got, _KAT))
    return ok, f"{sum(g == list(e) for g, (_, _, e) in zip(got, _KAT))}/3 Random123 vectors"


def check_slicing():
    x = _x((64, 1031), jnp.bfloat16)
    key = jr.key(1)
    whole = _bits(jax.jit(lambda x: jaxdet.dropout(x, key, 0.1))(x)).ravel()
    flat = x.ravel()
    cuts = [(0, 1), (3, 5000), (4097, 66000), (65983, 65984)]
    bad = sum(
        int(np.count_nonzero(_bits(jaxdet.dropout(flat[a:b], key, 0.1, offset=a)) != whole[a:b])) for a, b in cuts
    )
    return bad == 0, f"{len(cuts)} slices with offset, {bad} elements differ"


def check_dtypes():
    x = _x((128, 777))
    key = jr.key(2)
    masks = [np.asarray(jaxdet.dropout(x.astype(d), key, 0.3)) != 0 for d in (jnp.float32, jnp.bfloat16, jnp.float16)]
    diff = int(np.count_nonzero(masks[0] != masks[1]) + np.count_nonzero(masks[0] != masks[2]))
    return diff == 0, f"float32/bfloat16/float16 masks, {diff} elements differ"


def check_cpu_vs_gpu():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus or not jaxdet.WITH_CUDA:
        return None, "no GPU, or a CPU-only build"
    cpu = jax.devices("cpu")[0]
    x = np.asarray(_x((33, 4099), jnp.bfloat16))
    key = np.asarray(jr.key(3))
    f = jax.jit(lambda x, k: jaxdet.dropout(x, k, 0.25, offset=5))
    a = _bits(f(jax.device_put(x, cpu), jax.device_put(key, cpu)))
    b = _bits(f(jax.device_put(x, gpus[0]), jax.device_put(key, gpus[0])))
    diff = int(np.count_nonzero(a != b))
    return diff == 0, f"{x.size} bfloat16 elements, {diff} differ"


def check_keep_rate():
    n = 10**6
    worst = 0.0
    for rate in (0.1, 0.5):
        kept = float(jnp.count_nonzero(jaxdet.dropout(jnp.ones((n,), jnp.float32), jr.key(4), rate))) / n
        sigma = np.sqrt(rate * (1 - rate) / n)
        worst = max(worst, abs(kept - (1 - rate)) / sigma)
    return worst < 5.0, f"kept fraction within {worst:.2f} sigma of 1-rate (10^6 elements)"


def check_backward_residuals():
    x = _x((256, 256))
    key = jr.key(5)
    _, f_vjp = jax.vjp(lambda x: jaxdet.dropout(x, key, 0.1), x)
    largest = max((np.size(leaf) for leaf in jax.tree_util.tree_leaves(f_vjp)), default=0)
    return largest <= 2, f"largest backward residual: {largest} elements (the key)"


def report_checks():
    return [
        ("philox: known-answer vectors", check_kat),
        ("dropout: slice + offset == slice of whole", check_slicing),
        ("dropout: mask independent of dtype", check_dtypes),
        ("dropout: CPU bits == GPU bits", check_cpu_vs_gpu),
        ("dropout: keep rate", check_keep_rate),
        ("dropout: no mask kept for backward", check_backward_residuals),
    ]
