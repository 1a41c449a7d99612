"""Philox and dropout contracts as check functions (docs/random.md, docs/dropout.md).

The report calls them with their defaults; tests/test_random.py and tests/test_dropout.py call the
same functions over more dtypes, shapes and devices. Each returns (ok, detail); ok is None when the
contract cannot be measured here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet
from jaxdet._src.core.contract_checks import gpu_device
from jaxdet._src.core.testing import count_bit_differences
from jaxdet._src.dropout import random as jr

# Official Random123 known-answer vectors (tests/kat_vectors, philox4x32 with 10 rounds):
# (counter words, key words, output words).
KNOWN_ANSWERS = (
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
)

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def random_x(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


def check_kat(device=None):
    """philox4x32_10, eager and jitted, on `device` (default: the default device) vs Random123."""
    device = device or jax.devices()[0]
    good = 0
    for counter, key, expected in KNOWN_ANSWERS:
        c = jax.device_put(np.array(counter, np.uint32), device)
        k = jax.device_put(np.array(key, np.uint32), device)
        outs = [np.asarray(fn(c, k)).tolist() for fn in (jr.philox4x32_10, jax.jit(jr.philox4x32_10))]
        good += all(out == list(expected) for out in outs)
    return good == len(KNOWN_ANSWERS), f"{good}/{len(KNOWN_ANSWERS)} Random123 vectors on {device.platform}"


def check_slicing(dtype=jnp.bfloat16, shape=(64, 1031), cuts=((0, 1), (3, 5000), (4097, 66000), (65983, 65984))):
    """dropout(x).ravel()[a:b] == dropout(x.ravel()[a:b], offset=a), bitwise."""
    x = random_x(shape, dtype, seed=1)
    key = jr.key(1)
    whole = jax.jit(lambda x: jaxdet.dropout(x, key, 0.1))(x).ravel()
    flat = x.ravel()
    bad = sum(count_bit_differences(jaxdet.dropout(flat[a:b], key, 0.1, offset=a), whole[a:b]) for a, b in cuts)
    return bad == 0, f"{len(cuts)} slices of {jnp.dtype(dtype).name}{list(shape)} with offset, {bad} elements differ"


def check_dtypes(shape=(128, 777), rate=0.3):
    """The mask is the same for float32, bfloat16 and float16 inputs."""
    x = random_x(shape)
    key = jr.key(2)
    masks = [np.asarray(jaxdet.dropout(x.astype(d), key, rate)) != 0 for d in DTYPES]
    diff = int(np.count_nonzero(masks[0] != masks[1]) + np.count_nonzero(masks[0] != masks[2]))
    return diff == 0, f"float32/bfloat16/float16 masks, {diff} elements differ"


SPECIALS = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, 7e4], np.float32)


def check_cpu_vs_gpu(dtype=jnp.bfloat16, cases=(((33, 4099), 5), ((2, 4097), 2**35 + 6)), rate=0.3):
    """CPU and GPU kernels give the same bits, NaN/inf/subnormal inputs and 64-bit offsets included."""
    gpu = gpu_device()
    if gpu is None:
        return None, "no GPU, or a CPU-only build"
    cpu = jax.devices("cpu")[0]
    key = np.asarray(jr.key(3))
    diff, total = 0, 0
    for shape, offset in cases:
        x = np.array(random_x(shape, dtype, seed=shape[0]))
        with np.errstate(over="ignore"):
            x.ravel()[: SPECIALS.size] = SPECIALS[: x.size].astype(x.dtype)
        f = jax.jit(lambda x, k, offset=offset: jaxdet.dropout(x, k, rate, offset=offset))
        a = f(jax.device_put(x, cpu), jax.device_put(key, cpu))
        b = f(jax.device_put(x, gpu), jax.device_put(key, gpu))
        diff += count_bit_differences(a, b)
        total += x.size
    return diff == 0, f"{total} {jnp.dtype(dtype).name} elements (specials, 64-bit offsets), {diff} differ"


def check_keep_rate(rates=(0.1, 0.5), n=10**6):
    """The kept fraction and the output mean are within 5 sigma of 1 - rate and 1."""
    worst = 0.0
    for rate in rates:
        out = np.asarray(jaxdet.dropout(jnp.ones((n,), jnp.float32), jr.key(int(rate * 100)), rate), np.float64)
        q = 1.0 - rate
        sigma = np.sqrt(q * (1 - q) / n)
        worst = max(worst, abs(np.count_nonzero(out) / n - q) / sigma)
        worst = max(worst, (abs(out.mean() - 1.0) - 1e-6) / (float(jaxdet.dropout.keep_scale(rate)) * sigma))
    return worst < 5.0, f"kept fraction and mean within {worst:.2f} sigma (rates {list(rates)}, {n} elements)"


def check_backward_residuals():
    x = random_x((256, 256))
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
