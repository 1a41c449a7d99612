"""The contracts of jaxdet.embed and jaxdet.segment_sum as check functions (docs/embed.md).

The report calls them with their defaults (small shapes); tests/test_embed.py calls the same
functions with more dtypes, shapes and devices. Each returns (ok, detail); ok is None when the
contract cannot be measured here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet
from jaxdet._src.core.contract_checks import bitwise_verdict, gpu_device
from jaxdet._src.core.testing import same_bits
from jaxdet._src.embed import reference
from jaxdet._src.embed.embed import CHUNK_TOKENS

C = CHUNK_TOKENS


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def random_ids(shape, num_segments, seed=0, low=0, high=None):
    high = num_segments if high is None else high
    return jnp.asarray(np.random.default_rng(seed).integers(low, high, shape), jnp.int32)


@jax.jit
def table_grad(table, ids, g):
    """embed's table cotangent for the output cotangent g."""
    _, vjp = jax.vjp(lambda t: jaxdet.embed(t, ids), table)
    return vjp(g)[0]


@functools.partial(jax.jit, static_argnums=(2, 3))
def segment_sum(x, ids, num_segments, preferred_element_type=None):
    return jaxdet.segment_sum(x, ids, num_segments, preferred_element_type=preferred_element_type)


def _name(dtype):
    return jnp.dtype(dtype).name


def check_reference(dtype=jnp.bfloat16, tokens=3 * C + 17, d=4, num_segments=37):
    """segment_sum and embed's table gradient are the NumPy rule, bitwise (ids out of range included)."""
    x = rand((tokens, d), dtype, seed=1)
    ids = random_ids((tokens,), num_segments, seed=2, low=-2, high=num_segments + 2)
    want = reference.segment_sum(np.asarray(x), np.asarray(ids), num_segments)
    bad = []
    if not same_bits(segment_sum(x, ids, num_segments), want):
        bad.append("segment_sum")
    table = rand((num_segments, d), dtype, seed=3)
    in_range = jnp.where(ids < 0, num_segments, ids)  # embed wraps negative ids: keep them out of range
    if not same_bits(table_grad(table, in_range, x), want):
        bad.append("embed's table gradient")
    return bitwise_verdict(f"{tokens} {_name(dtype)} tokens, D={d}, V={num_segments} vs the NumPy rule: ", bad)


def check_padding(dtype=jnp.bfloat16, tokens=C + 300, d=8, num_segments=50):
    """Padding tokens change no bit of the table gradient: zero cotangents (any id), or ids out of
    range (any cotangent), within the last chunk or as new chunks."""
    table = rand((num_segments, d), dtype, seed=4)
    ids = random_ids((tokens,), num_segments, seed=5)
    g = rand((tokens, d), dtype, seed=6)
    full = table_grad(table, ids, g)
    bad = []
    for pad in (5, 2 * C):
        zeros = table_grad(
            table,
            jnp.concatenate([ids, random_ids((pad,), num_segments, 7)]),
            jnp.concatenate([g, jnp.zeros((pad, d), dtype)]),
        )
        nowhere = table_grad(
            table,
            jnp.concatenate([ids, jnp.full((pad,), num_segments, jnp.int32)]),
            jnp.concatenate([g, rand((pad, d), dtype, 8)]),
        )
        bad += [
            f"{what} +{pad}"
            for what, got in (("zero cotangents", zeros), ("ids out of range", nowhere))
            if not same_bits(got, full)
        ]
    return bitwise_verdict(f"{tokens} {_name(dtype)} tokens padded by 5 and {2 * C}: ", bad)


def check_microbatches(dtype=jnp.bfloat16, chunks=5, d=4, num_segments=23):
    """Micro-batches of 2^j whole chunks (float32 segment sums) combined by jaxdet.parallel.tree_sum
    are the whole batch's sum, bitwise (the last micro-batch may be shorter)."""
    tokens = chunks * C - 100
    x = rand((tokens, d), dtype, seed=9)
    ids = random_ids((tokens,), num_segments, seed=10)
    full = segment_sum(x, ids, num_segments)
    full32 = segment_sum(x, ids, num_segments, jnp.float32)
    bad = []
    for per in (1, 2, 4):
        n = per * C
        parts = [segment_sum(x[i : i + n], ids[i : i + n], num_segments, jnp.float32) for i in range(0, tokens, n)]
        total = jaxdet.parallel.tree_sum(parts)
        if not same_bits(total, full32) or not same_bits(total.astype(dtype), full):
            bad.append(f"{per} chunk(s) per micro-batch")
    return bitwise_verdict(f"{chunks} chunks of {_name(dtype)} in micro-batches of 1, 2, 4 chunks: ", bad)


def check_one_hot_matmul(dtype=jnp.float32, tokens=2 * C + 333, d=16, num_segments=40, device=None):
    """embed's table gradient equals the one-hot matmul's dB, matmul_weight_grad(one_hot(ids), g),
    cast to the table's dtype (the same rule; float32 on a GPU, whose half GEMM uses tensor cores)."""
    device = device or jax.devices()[0]
    if device.platform != "cpu" and jnp.dtype(dtype) != jnp.float32:
        return None, f"{_name(dtype)} on {device.platform}: the GEMM's tensor cores add in their own order"
    ids = random_ids((tokens,), num_segments, seed=11)
    table = rand((num_segments, d), dtype, seed=12)
    g = rand((tokens, d), dtype, seed=13)
    ids, table, g = jax.device_put((ids, table, g), device)
    ours = table_grad(table, ids, g)
    one_hot = jax.jit(
        lambda ids, g: jaxdet.matmul_weight_grad(jax.nn.one_hot(ids, num_segments, dtype=dtype), g).astype(dtype)
    )(ids, g)
    return bitwise_verdict(
        f"{tokens} {_name(dtype)} tokens on {device.platform}, vs matmul_weight_grad(one_hot(ids), g): ",
        [] if same_bits(ours, one_hot) else ["differ"],
    )


def check_cpu_vs_gpu(dtype=jnp.bfloat16, cases=((3 * C + 17, 4, 37), (1000, 300, 7), (5, 1030, 3))):
    """segment_sum and embed's table gradient: CPU bits == GPU bits (the rule is IEEE-exact)."""
    gpu = gpu_device()
    if gpu is None:
        return None, "no GPU, or a CPU-only build"
    cpu = jax.devices("cpu")[0]
    bad = []
    for tokens, d, v in cases:
        x = np.array(rand((tokens, d), dtype, seed=tokens))
        x.reshape(-1)[:4] = np.array([np.inf, -np.inf, 1e-40, -0.0], np.float32).astype(x.dtype)
        ids = np.asarray(random_ids((tokens,), v, seed=d, low=-1, high=v + 1))
        table = np.asarray(rand((v, d), dtype, seed=v))
        on = {}
        for dev in (cpu, gpu):
            xd, idd, td = jax.device_put((x, ids, table), dev)
            on[dev.platform] = (
                segment_sum(xd, idd, v),
                table_grad(td, jnp.where(idd < 0, v, idd), xd),
            )
        for name, a, b in zip(("segment_sum", "table gradient"), on["cpu"], on["gpu"]):
            if not same_bits(a, b):
                bad.append(f"{name} {[tokens, d, v]}")
    return bitwise_verdict(f"{_name(dtype)} CPU vs {gpu.device_kind} at {len(cases)} shapes: ", bad)


def report_checks():
    return [
        ("embed table gradient: the NumPy rule (bf16, 4 chunks)", check_reference),
        ("embed table gradient: padding tokens change no bit", check_padding),
        ("embed table gradient: micro-batches of whole chunks reproduce the batch", check_microbatches),
        ("embed table gradient: equals one-hot matmul_weight_grad (f32)", check_one_hot_matmul),
        ("segment_sum: CPU bits == GPU bits", check_cpu_vs_gpu),
    ]
