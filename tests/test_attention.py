"""jaxdet.attention: the contracts of docs/attention.md, on the CPU and (marked gpu) on the GPU.

Bitwise contracts are checked on raw bits (jaxdet.testing); accuracy against a float64 NumPy
reference by relative norm.
"""

import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from jax import lax
from jax.test_util import check_grads
from special_values import sprinkle_special

import jaxdet
from jaxdet._src.attention import contracts
from jaxdet._src.attention.attention import KV_SPLIT

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _device(name):
    return jax.devices(name)[0]


def _rand(shape, dtype=jnp.float32, seed=0, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    return jnp.asarray(x).astype(dtype)


def _qkv(B, T, S, N, K, D, dtype=jnp.float32, seed=0):
    return _rand((B, T, N, D), dtype, seed), _rand((B, S, K, D), dtype, seed + 1), _rand((B, S, K, D), dtype, seed + 2)


def reference(q, k, v, *, causal=True, scale=None, q_positions=None, kv_lengths=None, segment_ids=None):
    """float64 NumPy attention with the documented masking."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    B, T, N, D = q.shape
    S, K = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = np.repeat(k, N // K, axis=2)
    v = np.repeat(v, N // K, axis=2)
    j = np.arange(S)[None, None, :]
    if segment_ids is not None:
        seg = np.asarray(segment_ids)
        mask = seg[:, :, None] == seg[:, None, :]
        if causal:
            mask &= j <= np.arange(T)[None, :, None]
    else:
        kvl = np.full((B,), S) if kv_lengths is None else np.broadcast_to(np.asarray(kv_lengths), (B,))
        mask = j < kvl[:, None, None]
        if causal:
            pos = np.arange(T) if q_positions is None else np.asarray(q_positions)
            mask = mask & (j <= np.broadcast_to(pos, (B, T))[:, :, None])
    s = np.einsum("btnd,bsnd->bnts", q, k) * scale
    s = np.where(mask[:, None], s, -np.inf)
    mx = np.max(s, axis=-1, keepdims=True)
    p = np.where(mask[:, None], np.exp(s - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
    denom = p.sum(-1, keepdims=True)
    p = np.divide(p, denom, out=np.zeros_like(p), where=denom > 0)
    return np.einsum("bnts,bsnd->btnd", p, v)


def _relerr(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


# ---- Accuracy. ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("N,K,D", [(4, 4, 64), (8, 2, 128), (4, 1, 256)])
def test_matches_float64_reference(device, dtype, causal, N, K, D):
    q, k, v = _qkv(2, 130, 130, N, K, D, dtype)
    with jax.default_device(_device(device)):
        out = jaxdet.attention(q, k, v, causal=causal)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert _relerr(out, reference(q, k, v, causal=causal)) < TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_long_rows_cross_splits(device):
    # 1100 keys: three splits of 512, the last one partial.
    q, k, v = _qkv(1, 1100, 1100, 2, 1, 64)
    with jax.default_device(_device(device)):
        out = jaxdet.attention(q, k, v)
    assert _relerr(out, reference(q, k, v)) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [64, 128])
def test_decode_against_a_long_cache_matches_float64(device, D):
    # One query per sequence against caches of 700-1500 positions (the GPU's split mode: a CTA per
    # split, then the combine), each sequence at its own length.
    q, k, v = _qkv(3, 1, 1500, 8, 2, D, jnp.bfloat16, seed=5)
    lengths = jnp.asarray([700, 1100, 1500])
    with jax.default_device(_device(device)):
        out = jaxdet.attention(q, k, v, q_positions=(lengths - 1)[:, None], kv_lengths=lengths)
    want = reference(q, k, v, q_positions=(lengths - 1)[:, None], kv_lengths=lengths)
    assert _relerr(out, want) < TOLERANCE[jnp.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
def test_scale_and_masks(device):
    q, k, v = _qkv(3, 20, 40, 4, 2, 64)
    pos = jnp.asarray([[i + 20 for i in range(20)], [i for i in range(20)], [39 - i for i in range(20)]], jnp.int32)
    kvl = jnp.asarray([40, 25, 7], jnp.int32)
    with jax.default_device(_device(device)):
        out = jaxdet.attention(q, k, v, scale=0.3, q_positions=pos, kv_lengths=kvl)
    assert _relerr(out, reference(q, k, v, scale=0.3, q_positions=pos, kv_lengths=kvl)) < 1e-5


# ---- Row invariance. ----


def _embed(x, batch, at, seed):
    """x (batch 1) placed at index `at` of a batch of random other rows."""
    others = _rand((batch,) + x.shape[1:], x.dtype, seed)
    return others.at[at].set(x[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_rows_do_not_depend_on_the_batch(device, dtype, D):
    q, k, v = _qkv(1, 70, 70, 8, 2, D, dtype)
    f = jax.jit(lambda q, k, v: jaxdet.attention(q, k, v))
    with jax.default_device(_device(device)):
        alone = f(q, k, v)
        for batch in (4, 16, 64):
            for at in (0, batch // 2, batch - 1):
                out = f(*(_embed(x, batch, at, seed=batch + i) for i, x in enumerate((q, k, v))))
                assert_bitwise(out[at : at + 1], alone)


@pytest.mark.parametrize("device", DEVICES)
def test_permuted_batch(device):
    q, k, v = _qkv(8, 33, 33, 4, 4, 64, jnp.bfloat16)
    perm = np.random.default_rng(3).permutation(8)
    f = jax.jit(lambda q, k, v: jaxdet.attention(q, k, v))
    with jax.default_device(_device(device)):
        assert_bitwise(f(q[perm], k[perm], v[perm]), f(q, k, v)[perm])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
def test_padding_is_never_seen(device, causal):
    L, S = 45, 128
    q, k, v = _qkv(1, L, L, 4, 2, 64, jnp.bfloat16)
    pad = lambda x, fill: jnp.concatenate([x, jnp.full((1, S - L) + x.shape[2:], fill, x.dtype)], 1)  # noqa: E731
    with jax.default_device(_device(device)):
        alone = jaxdet.attention(q, k, v, causal=causal)
        for fill in (0.0, 1e4, jnp.nan):
            qp, kp, vp = pad(q, 0.0), pad(k, fill), pad(v, fill)
            out = jaxdet.attention(qp, kp, vp, causal=causal, kv_lengths=jnp.asarray([L]))
            assert_bitwise(out[:, :L], alone)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
def test_packed_segments_equal_alone(device, causal):
    lengths = [37, 64, 1, 100, 30]
    T = sum(lengths)
    q, k, v = _qkv(1, T, T, 4, 2, 64, jnp.bfloat16)
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    with jax.default_device(_device(device)):
        packed = jaxdet.attention(q, k, v, causal=causal, segment_ids=seg)
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            alone = jaxdet.attention(q[:, sl], k[:, sl], v[:, sl], causal=causal)
            assert_bitwise(packed[:, sl], alone)
            start += n
    ref = reference(q, k, v, causal=causal, segment_ids=seg)
    assert _relerr(packed, ref) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_gqa_equals_repeated_heads(device):
    q, k, v = _qkv(2, 50, 50, 8, 2, 64, jnp.bfloat16)
    with jax.default_device(_device(device)):
        gqa = jaxdet.attention(q, k, v)
        mha = jaxdet.attention(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2))
    assert_bitwise(gqa, mha)


# ---- Prefill/decode invariance. ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_chunked_prefill_equals_full(device, dtype):
    T, cap = 700, 1024
    q, k, v = _qkv(2, T, T, 4, 2, 64, dtype)
    with jax.default_device(_device(device)):
        full = jaxdet.attention(q, k, v)
        garbage = _rand((2, cap, 2, 64), dtype, 9, scale=1e3)
        for cuts in ([0, 37, 100, 513, 700], [0, 1, 2, 64, 511, 512, 699, 700], [0, 350, 700]):
            kc, vc = garbage, garbage
            for a, b in zip(cuts[:-1], cuts[1:]):
                kc = kc.at[:, a:b].set(k[:, a:b])
                vc = vc.at[:, a:b].set(v[:, a:b])
                pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
                out = jaxdet.attention(q[:, a:b], kc, vc, q_positions=pos, kv_lengths=jnp.asarray([b, b]))
                assert_bitwise(out, full[:, a:b])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [64, 128])
def test_prefill_chunks_and_decode_equal_full_with_special_values(device, D):
    # NaN, +-inf, huge (scores that overflow float32), subnormal and zero inputs: chunks of 1, 2, 62
    # and more rows (other tile shapes than the full pass's) and single-query decode steps give the
    # full pass's bits, NaN outputs included. On the GPU the tensor-core tiles hold positions a query
    # does not see, whose infs must not reach it as 0 x inf (docs/attention.md, "Non-finite inputs").
    T, dtype = 130, jnp.bfloat16
    rng = np.random.default_rng(D)
    q, k, v = (
        jnp.asarray(sprinkle_special(rng.standard_normal(s), rng, dtype), dtype)
        for s in [(2, T, 8, D), (2, T, 2, D), (2, T, 2, D)]
    )
    with jax.default_device(_device(device)):
        full = jaxdet.attention(q, k, v)
        for a, b in zip([0, 1, 3, 65, 127], [1, 3, 65, 127, 130]):
            pos = jnp.broadcast_to(jnp.arange(a, b, dtype=jnp.int32), (2, b - a))
            out = jaxdet.attention(q[:, a:b], k, v, q_positions=pos, kv_lengths=jnp.asarray([b, b]))
            assert_bitwise(out, full[:, a:b])
        assert_bitwise(jax.jit(_decode_all, static_argnums=3)(q, k, v, T), full)


def _decode_all(q, k, v, capacity):
    """A token-by-token decode loop: step t writes k_t, v_t into a KV cache of `capacity` positions
    (filled with NaN beforehand) and attends with its single query."""
    B, T, N, D = q.shape
    K = k.shape[2]
    cache0 = jnp.full((B, capacity, K, D), jnp.nan, q.dtype)

    def step(carry, t):
        kc, vc = carry
        kc = lax.dynamic_update_slice_in_dim(kc, lax.dynamic_slice_in_dim(k, t, 1, 1), t, 1)
        vc = lax.dynamic_update_slice_in_dim(vc, lax.dynamic_slice_in_dim(v, t, 1, 1), t, 1)
        qt = lax.dynamic_slice_in_dim(q, t, 1, 1)
        pos = jnp.full((B, 1), t, jnp.int32)
        out = jaxdet.attention(qt, kc, vc, q_positions=pos, kv_lengths=jnp.full((B,), t + 1, jnp.int32))
        return (kc, vc), out[:, 0]

    _, outs = lax.scan(step, (cache0, cache0), jnp.arange(T))
    return jnp.moveaxis(outs, 0, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("D", [64, 128])
def test_decode_step_by_step_equals_full(device, dtype, D):
    T = 600
    q, k, v = _qkv(2, T, T, 8, 2, D, dtype)
    decode = jax.jit(_decode_all, static_argnums=3)
    with jax.default_device(_device(device)):
        full = jaxdet.attention(q, k, v)
        for factor in (1, 2, 3, 4):
            assert_bitwise(decode(q, k, v, factor * T), full)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_past_many_splits_equals_full(device):
    # Single-query decode steps against a cache of 3T positions give the rows of the full causal
    # pass, at positions 0-4 split boundaries in (kv splits of KV_SPLIT positions). On the GPU the
    # full pass runs in final mode (one CTA merges a row's splits as it goes) and the decode steps
    # in split mode (a CTA per split, then CombineKernel merges them): two kernels, one order.
    B, T = 2, 2100
    q, k, v = _qkv(B, T, T, 4, 2, 128, jnp.bfloat16, seed=21)
    pad = jnp.full((B, 2 * T, 2, 128), jnp.nan, k.dtype)
    kc, vc = jnp.concatenate([k, pad], 1), jnp.concatenate([v, pad], 1)
    with jax.default_device(_device(device)):
        full = jaxdet.attention(q, k, v)
        for t in (KV_SPLIT - 1, KV_SPLIT, 3 * KV_SPLIT + 5, T - 1):
            pos = jnp.full((B, 1), t, jnp.int32)
            out = jaxdet.attention(q[:, t : t + 1], kc, vc, q_positions=pos, kv_lengths=jnp.full((B,), t + 1))
            assert_bitwise(out, full[:, t : t + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_decode_past_a_combine_round_equals_the_prefill_rows(D):
    # CombineKernel merges a row's splits in rounds of D splits, whose partial outputs it loads 64
    # at a time: 67 splits are two rounds at D = 64 and two loads at D = 128. Decode steps there
    # (split mode) give the rows of a prefill chunk of 2112 queries (final mode: one CTA merges a
    # row's splits as it goes) bitwise, with 64, 65 and 67 splits.
    S, T = 67 * KV_SPLIT - 100, 2112
    first = S - T
    q, k, v = _qkv(1, T, S, 8, 1, D, jnp.bfloat16, seed=31)
    with jax.default_device(_device("gpu")):
        positions = jnp.arange(first, S, dtype=jnp.int32)[None]
        chunk = jaxdet.attention(q, k, v, q_positions=positions, kv_lengths=jnp.asarray([S]))
        for t in (64 * KV_SPLIT - 1, 64 * KV_SPLIT, S - 1):
            i, pos, n = t - first, jnp.full((1, 1), t, jnp.int32), jnp.asarray([t + 1])
            step = jaxdet.attention(q[:, i : i + 1], k, v, q_positions=pos, kv_lengths=n)
            assert_bitwise(step, chunk[:, i : i + 1], f"position {t}")
    want = reference(q[:, -1:], k, v, q_positions=jnp.full((1, 1), S - 1), kv_lengths=jnp.asarray([S]))
    assert _relerr(chunk[:, -1:], want) < TOLERANCE[jnp.bfloat16]


# ---- Transformations. ----


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_and_jit(device):
    q, k, v = _qkv(6, 40, 40, 4, 2, 64, jnp.bfloat16)
    with jax.default_device(_device(device)):
        direct = jaxdet.attention(q, k, v)
        # vmap over the batch, with per-example rank-3 inputs
        assert_bitwise(jax.vmap(lambda a, b, c: jaxdet.attention(a, b, c))(q, k, v), direct)
        assert_bitwise(jax.jit(jaxdet.attention)(q, k, v), direct)
        # a vmapped axis over shared keys and values
        qs = jnp.stack([q, q[::-1]])
        shared = jax.vmap(lambda a: jaxdet.attention(a, k, v))(qs)
        assert_bitwise(shared[0], direct)
        assert_bitwise(shared[1][::-1], jaxdet.attention(q[::-1], k, v)[::-1])
        # vmapped q_positions (decode of several candidates against one cache)
        ts = (3, 17, 39)
        qt = jnp.stack([q[:, t : t + 1] for t in ts])
        pos = jnp.asarray([[t] for t in ts], jnp.int32)
        outs = jax.vmap(lambda a, p: jaxdet.attention(a, k, v, q_positions=jnp.broadcast_to(p, (6, 1))))(qt, pos)
        for i, t in enumerate(ts):
            assert_bitwise(outs[i], direct[:, t : t + 1])


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    q, k, v = _qkv(2, 90, 90, 4, 2, 64, jnp.bfloat16)
    with jax.default_device(_device(device)):
        a = jax.jit(jaxdet.attention)(q, k, v)
        jax.clear_caches()
        b = jax.jit(jaxdet.attention)(q, k, v)
    assert_bitwise(a, b)


# ---- Gradients. ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False])
def test_check_grads(device, causal):
    q, k, v = _qkv(2, 9, 9, 4, 2, 64)
    with jax.default_device(_device(device)):
        check_grads(
            lambda q, k, v: jaxdet.attention(q, k, v, causal=causal),
            (q, k, v),
            order=1,
            modes=["rev"],
            atol=1e-2,
            rtol=1e-2,
        )


def _loss_weights(shape, seed=7):
    return _rand(shape, jnp.float32, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("N,K,D", [(4, 2, 64), (4, 4, 128), (2, 1, 256)])
def test_gradients_match_float64(device, dtype, N, K, D):
    q, k, v = _qkv(2, 70, 70, N, K, D, dtype)
    w = _loss_weights((2, 70, N, D))
    kvl = jnp.asarray([70, 51])

    def loss(q, k, v, impl):
        if impl == "jaxdet":
            o = jaxdet.attention(q, k, v, kv_lengths=kvl)
        else:
            mask = (jnp.arange(70)[None, :] < kvl[:, None])[:, None, None, :]
            o = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
        return jnp.sum(o.astype(jnp.float32) * w)

    with jax.default_device(_device(device)):
        got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, "jaxdet")
    with jax.default_device(jax.devices("cpu")[0]), jax.enable_x64(True):
        want = jax.grad(loss, argnums=(0, 1, 2))(*(jnp.asarray(x, jnp.float64) for x in (q, k, v)), "xla")
    tol = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}[dtype]
    for g, r in zip(got, want):
        assert g.dtype == q.dtype
        assert _relerr(g, np.asarray(r)) < tol


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_rows_do_not_depend_on_the_batch(device):
    q, k, v = _qkv(1, 60, 60, 4, 2, 64, jnp.bfloat16)
    w = _loss_weights((1, 60, 4, 64))

    def grads(q, k, v, w):
        return jax.grad(lambda q, k, v: jnp.sum(jaxdet.attention(q, k, v).astype(jnp.float32) * w), argnums=(0, 1, 2))(
            q, k, v
        )

    f = jax.jit(grads)
    with jax.default_device(_device(device)):
        alone = f(q, k, v, w)
        for batch, at in ((4, 3), (16, 0), (16, 9)):
            big = [_embed(x, batch, at, seed=batch + i) for i, x in enumerate((q, k, v, w))]
            out = f(*big)
            for g, a in zip(out, alone):  # dq rows, and this sequence's dk/dv
                assert_bitwise(g[at : at + 1], a)


@pytest.mark.parametrize("device", DEVICES)
def test_dq_rows_of_a_chunk_equal_the_full_pass(device):
    T, a, b = 300, 130, 217
    q, k, v = _qkv(1, T, T, 4, 2, 64, jnp.bfloat16)
    w = _loss_weights((1, T, 4, 64))
    with jax.default_device(_device(device)):
        full = jax.grad(lambda q: jnp.sum(jaxdet.attention(q, k, v).astype(jnp.float32) * w))(q)
        pos = jnp.arange(a, b, dtype=jnp.int32)[None]
        chunk = jax.grad(
            lambda qc: jnp.sum(jaxdet.attention(qc, k, v, q_positions=pos).astype(jnp.float32) * w[:, a:b])
        )(q[:, a:b])
    assert_bitwise(chunk, full[:, a:b])


@pytest.mark.parametrize("device", DEVICES)
def test_dq_rows_of_packed_sequences_equal_alone(device):
    lengths = [37, 100, 50]
    T = sum(lengths)
    q, k, v = _qkv(1, T, T, 4, 2, 64, jnp.bfloat16)
    w = _loss_weights((1, T, 4, 64))
    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)

    def dq(q, k, v, w, **kw):
        return jax.grad(lambda q: jnp.sum(jaxdet.attention(q, k, v, **kw).astype(jnp.float32) * w))(q)

    with jax.default_device(_device(device)):
        packed = dq(q, k, v, w, segment_ids=seg)
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            assert_bitwise(packed[:, sl], dq(q[:, sl], k[:, sl], v[:, sl], w[:, sl]))
            start += n


def _special_qkvw(shapes, seed, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(sprinkle_special(rng.standard_normal(s), rng, dtype), dtype) for s in shapes[:3]] + [
        jnp.asarray(sprinkle_special(rng.standard_normal(shapes[3]), rng, dtype), jnp.float32)
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [64, 128])
def test_gradients_keep_their_invariance_with_special_values(device, D):
    # Special values in q, k, v and the output gradient, which the GPU tiles hold beside rows that do
    # not see them (dS.K for dQ, dS^T.Q and P^T.dO for dK/dV): dQ rows of chunks equal the full
    # pass's, a packed sequence's dQ equals its own pass's, and dK/dV of keys do not depend on the
    # rows that do not see them (other sequences; earlier positions), finite or not.
    lengths = [37, 64, 1, 28]
    T = sum(lengths)
    q, k, v, w = _special_qkvw([(1, T, 8, D), (1, T, 2, D), (1, T, 2, D), (1, T, 8, D)], seed=D + 1)
    plain = [_rand(x.shape, x.dtype, seed=i) for i, x in enumerate((q, k, v, w))]

    def grads(q, k, v, w, **kw):
        return jax.grad(
            lambda q, k, v: jnp.sum(jaxdet.attention(q, k, v, **kw).astype(jnp.float32) * w), argnums=(0, 1, 2)
        )(q, k, v)

    seg = jnp.asarray(np.repeat(np.arange(len(lengths)), lengths)[None], jnp.int32)
    with jax.default_device(_device(device)):
        full = grads(q, k, v, w)
        for a, b in zip([0, 1, 3, 65, 127], [1, 3, 65, 127, T]):
            pos = jnp.arange(a, b, dtype=jnp.int32)[None]
            dq = grads(q[:, a:b], k, v, w[:, a:b], q_positions=pos, kv_lengths=jnp.asarray([b]))[0]
            assert_bitwise(dq, full[0][:, a:b])
        # keys from position t on are not seen by the rows before t: their q and dO do not matter
        for t in (5, 64, 100):
            qt, wt = (jnp.concatenate([p[:, :t], x[:, t:]], axis=1) for p, x in ((plain[0], q), (plain[3], w)))
            mixed = grads(qt, k, v, wt)
            for g, f in zip(mixed[1:], full[1:]):
                assert_bitwise(g[:, t:], f[:, t:])
        packed = grads(q, k, v, w, segment_ids=seg)
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            assert_bitwise(packed[0][:, sl], grads(q[:, sl], k[:, sl], v[:, sl], w[:, sl])[0])
            # the other sequences' inputs replaced by finite ones
            others = [x.at[:, sl].set(y[:, sl]) for x, y in zip(plain, (q, k, v, w))]
            for g, f in zip(grads(*others, segment_ids=seg)[1:], packed[1:]):
                assert_bitwise(g[:, sl], f[:, sl])
            start += n


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_deterministic(device):
    q, k, v = _qkv(2, 80, 80, 4, 2, 64, jnp.bfloat16)
    f = jax.jit(
        jax.grad(lambda q, k, v: jnp.sum(jaxdet.attention(q, k, v).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    )
    with jax.default_device(_device(device)):
        a = f(q, k, v)
        b = f(q, k, v)
    for x, y in zip(a, b):
        assert_bitwise(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_under_remat_and_scan_are_bitwise_the_plain_ones(device):
    """jax.checkpoint recomputes the forward in the backward pass and lax.scan runs the layers as a
    loop: both call the same kernels on the same operands, so the gradients keep their bits."""
    q, k, v = _qkv(2, 40, 40, 4, 2, 64, jnp.bfloat16)
    w = _loss_weights((2, 40, 4, 64))

    def layer(q, k, v):
        return jaxdet.attention(q, k, v).astype(jnp.float32)

    def loss(layer_fn, q, k, v):
        def step(x, _):
            y = layer_fn(x.astype(q.dtype), k, v)
            return y, jnp.sum(y * w)

        _, per_layer = lax.scan(step, q.astype(jnp.float32), None, length=2)
        return jnp.sum(per_layer)

    grad = lambda fn: jax.jit(jax.grad(lambda *a: loss(fn, *a), argnums=(0, 1, 2)))  # noqa: E731
    with jax.default_device(_device(device)):
        plain = grad(layer)(q, k, v)
        remat = grad(jax.checkpoint(layer))(q, k, v)
    for x, y in zip(plain, remat):
        assert_bitwise(x, y)


# ---- Edge cases and errors. ----


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_see_nothing_are_zero(device):
    q, k, v = _qkv(2, 4, 8, 2, 2, 64)
    with jax.default_device(_device(device)):
        out = jaxdet.attention(
            q, k, v, kv_lengths=jnp.asarray([0, 8]), q_positions=jnp.asarray([[0, 1, 2, 3], [-1, 0, 5, 9]])
        )
    out = np.asarray(out)
    assert not np.any(out[0]) and not np.any(out[1, 0])
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("device", DEVICES)
def test_positions_and_lengths_out_of_range_are_clamped(device):
    # Without segment_ids the kernels receive q_positions and kv_lengths as given and clamp them
    # (docs/attention.md, "Which keys a query sees"): any int32 is a valid position or length.
    q, k, v = _qkv(4, 3, 16, 4, 2, 64)
    big, small = 2**31 - 1, -(2**31)
    pos = jnp.asarray([[small, -7, -1], [0, 15, 16], [big, 100, 3], [5, 6, 7]], jnp.int32)
    kvl = jnp.asarray([small, big, 9, -3], jnp.int32)
    with jax.default_device(_device(device)):
        causal = jaxdet.attention(q, k, v, q_positions=pos, kv_lengths=kvl)
        not_causal = jaxdet.attention(q, k, v, causal=False, kv_lengths=kvl)
    assert _relerr(causal, reference(q, k, v, q_positions=pos, kv_lengths=kvl)) < 1e-5
    assert _relerr(not_causal, reference(q, k, v, causal=False, kv_lengths=kvl)) < 1e-5
    seen_nothing = np.asarray(causal)[[0, 0, 0, 3, 3, 3, 1], [0, 1, 2, 0, 1, 2, 0]]
    assert not np.any(seen_nothing[:-1]) and np.any(seen_nothing[-1])


def test_a_decode_step_hands_its_positions_to_the_kernel_as_they_are():
    # int32 q_positions [B, 1] and kv_lengths [B] are the forward call's operands themselves: no
    # computation of the rows' limits runs before it (a kernel of its own on a GPU, each step).
    q, k, v = _qkv(2, 1, 64, 4, 2, 64, jnp.bfloat16)
    step = jax.jit(lambda q, k, v, p, n: jaxdet.attention(q, k, v, q_positions=p, kv_lengths=n))
    hlo = step.lower(q, k, v, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2,), jnp.int32)).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    params = dict(re.findall(r"%(\S+) = \S+ parameter\((\d)\)", entry))
    params = {int(i): name for name, i in params.items()}
    call = next(line for line in entry.splitlines() if 'custom_call_target="jaxdet_attention_fwd"' in line)
    operands = re.search(r"custom-call\(([^)]*)\)", call).group(1).split(", ")
    assert operands[3:] == [f"%{params[3]}", f"%{params[4]}"], call


def test_rank3_and_empty():
    q, k, v = _qkv(1, 10, 10, 4, 2, 64)
    assert_bitwise(jaxdet.attention(q[0], k[0], v[0]), jaxdet.attention(q, k, v)[0])
    empty = jaxdet.attention(q[:, :0], k, v, q_positions=jnp.zeros((1, 0), jnp.int32))
    assert empty.shape == (1, 0, 4, 64)


# ---- Masks (docs/attention.md, "Masks"). ----


def _masked(q, k, v, mask, **kw):
    return jax.jit(lambda q, k, v, m: jaxdet.attention(q, k, v, mask=m, **kw))(q, k, v, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_mask_forms_equal_the_positions_forms(device):
    """A causal mask, a decode step's full-length cache mask and a left-padded prompt's mask give
    the bits of the same keys described by positions and lengths (a row is computed from its first
    visible key)."""
    B, T, N, K, D = 2, 70, 4, 2, 64
    q, k, v = _qkv(B, T, T, N, K, D, jnp.bfloat16)
    with jax.default_device(_device(device)):
        full = jaxdet.attention(q, k, v)
        assert_bitwise(_masked(q, k, v, jnp.tril(jnp.ones((T, T), bool)), causal=False), full)
        assert_bitwise(_masked(q, k, v, jnp.ones((B, 1, T, T), bool)), full)  # ANDed with causal
        steps = [_masked(q[:, t : t + 1], k, v, (jnp.arange(T) <= t)[None, None, None], causal=False) for t in range(T)]
        assert_bitwise(jnp.concatenate(steps, 1), full)
        pad = 5
        shift = lambda x: jnp.concatenate([jnp.full((1, pad) + x.shape[2:], 7.0, x.dtype), x[:1, : T - pad]], 1)  # noqa: E731
        padded = _masked(shift(q), shift(k), shift(v), (jnp.arange(T) >= pad)[None, None, None])
        assert_bitwise(padded[:, pad:], jaxdet.attention(q[:1, : T - pad], k[:1, : T - pad], v[:1, : T - pad]))
    ref = reference(q, k, v)
    assert _relerr(full, ref) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_mask_window_matches_float64(device):
    """A sliding window (each query sees its last W keys) is one run per row."""
    T, W = 200, 48
    q, k, v = _qkv(1, T, T, 4, 2, 64)
    i = np.arange(T)
    window = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
    with jax.default_device(_device(device)):
        out = _masked(q, k, v, jnp.asarray(window))
        for t in (0, W - 1, W, T - 1):
            lo = max(0, t - W + 1)
            alone = jaxdet.attention(q[:, t : t + 1], k[:, lo : t + 1], v[:, lo : t + 1], causal=False)
            assert_bitwise(out[:, t : t + 1], alone)
    qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
    kf, vf = np.repeat(kf, 2, 2), np.repeat(vf, 2, 2)
    s = np.einsum("btnd,bsnd->bnts", qf, kf) / 8.0
    s = np.where(window[None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bnts,bsnd->btnd", p / p.sum(-1, keepdims=True), vf)
    assert _relerr(out, want) < TOLERANCE[jnp.float32]


@pytest.mark.parametrize("device", DEVICES)
def test_mask_rows_without_a_run_are_nan_or_an_error(device):
    T = 16
    q, k, v = _qkv(1, T, T, 4, 2, 64)
    holes = np.ones((T, T), bool)
    holes[5:, 3] = False  # rows 5.. see keys 0-2 and 4..: two runs
    with jax.default_device(_device(device)):
        out = _masked(q, k, v, jnp.asarray(holes), causal=False)
        bad = np.asarray(jnp.isnan(out).all(axis=(2, 3)))[0]
        assert bad.tolist() == [False] * 5 + [True] * (T - 5)
        heads = np.ones((1, 4, T, T), bool)
        heads[0, 1, :, 0] = False
        assert np.asarray(jnp.isnan(_masked(q, k, v, jnp.asarray(heads), causal=False))).all()
        with pytest.raises(ValueError, match=r"query \(batch 0, position 5\) sees are not one contiguous run"):
            jaxdet.attention(q, k, v, causal=False, mask=holes)


@pytest.mark.parametrize("device", DEVICES)
def test_mask_gradients_equal_the_positions_forms(device):
    q, k, v = _qkv(2, 40, 40, 4, 2, 64)
    mask = jnp.tril(jnp.ones((40, 40), bool))
    with jax.default_device(_device(device)):
        want = jax.grad(lambda q, k, v: jaxdet.attention(q, k, v).sum(), (0, 1, 2))(q, k, v)
        got = jax.grad(lambda q, k, v: jaxdet.attention(q, k, v, causal=False, mask=mask).sum(), (0, 1, 2))(q, k, v)
        for g, w in zip(got, want):
            assert_bitwise(g, w)


# ---- Head dimensions and sliding windows (docs/attention.md). ----


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", [32, 80, 96, 160, 240])
def test_other_head_dimensions_match_float64_and_keep_the_contracts(device, D):
    """Head dimensions between the kernels' run on the next kernel with zero columns: accurate,
    rows the same alone and in a batch, decode == prefill, gradients accurate."""
    q, k, v = _qkv(3, 40, 40, 4, 2, D, jnp.bfloat16)
    with jax.default_device(_device(device)):
        full = jaxdet.attention(q, k, v)
        assert full.shape == q.shape
        assert_bitwise(jaxdet.attention(q[1:2], k[1:2], v[1:2]), full[1:2])
        t = 29
        step = jaxdet.attention(
            q[:, t : t + 1], k, v, q_positions=jnp.full((3, 1), t), kv_lengths=jnp.full((3,), t + 1)
        )
        assert_bitwise(step, full[:, t : t + 1])
        g = jax.grad(lambda q, k, v: jnp.sum(jaxdet.attention(q, k, v).astype(jnp.float32) ** 2), (0, 1, 2))
        got = g(q, k, v)
    assert _relerr(full, reference(q, k, v)) < TOLERANCE[jnp.bfloat16]
    qf, kf, vf = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    want = jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2), (0, 1, 2))(
        qf, kf, vf
    )
    for a, b in zip(got, want):
        assert _relerr(a, np.asarray(b, np.float64)) < 3e-2


@pytest.mark.parametrize("device", DEVICES)
def test_window_equals_the_window_alone_and_decode(device):
    """window=W: a query sees its last W positions; its row is the bits of those keys alone (from
    position 0), in prefill, in decode against a longer cache and packed with segment_ids."""
    T, W = 150, 40
    q, k, v = _qkv(2, T, T, 4, 2, 64, jnp.bfloat16)
    with jax.default_device(_device(device)):
        full = jaxdet.attention(q, k, v, window=W)
        for t in (0, W - 1, W, 97, T - 1):
            lo = max(0, t - W + 1)
            alone = jaxdet.attention(q[:, t : t + 1], k[:, lo : t + 1], v[:, lo : t + 1], causal=False)
            assert_bitwise(full[:, t : t + 1], alone)
            cache = lambda x: jnp.concatenate([x, jnp.full((2, 64) + x.shape[2:], 3.0, x.dtype)], 1)  # noqa: E731
            step = jaxdet.attention(
                q[:, t : t + 1],
                cache(k),
                cache(v),
                q_positions=jnp.full((2, 1), t),
                kv_lengths=jnp.full((2,), t + 1),
                window=W,
            )
            assert_bitwise(step, full[:, t : t + 1])
        seg = jnp.asarray(np.repeat([0, 1], [60, T - 60])[None].repeat(2, 0), jnp.int32)
        packed = jaxdet.attention(q, k, v, segment_ids=seg, window=W)
        assert_bitwise(packed[:, 60:], jaxdet.attention(q[:, 60:], k[:, 60:], v[:, 60:], window=W))
        i = np.arange(T)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - W)
        assert_bitwise(jaxdet.attention(q, k, v, mask=jnp.asarray(mask)), full)
    with pytest.raises(TypeError, match="window must be a Python int >= 1"):
        jaxdet.attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="window needs causal=True"):
        jaxdet.attention(q, k, v, causal=False, window=4)


def test_mask_errors():
    q, k, v = _qkv(2, 8, 8, 4, 2, 64)
    with pytest.raises(TypeError, match="mask must be a boolean array"):
        jaxdet.attention(q, k, v, mask=jnp.ones((8, 8), jnp.float32))
    with pytest.raises(ValueError, match=r"mask must broadcast to \[B, 1 or N, T, S\]"):
        jaxdet.attention(q, k, v, mask=jnp.ones((2, 3, 8, 8), bool))
    with pytest.raises(ValueError, match="segment_ids excludes mask"):
        jaxdet.attention(q, k, v, mask=jnp.ones((8, 8), bool), segment_ids=jnp.zeros((2, 8), jnp.int32))


def test_errors():
    q, k, v = _qkv(2, 8, 8, 4, 2, 64)
    with pytest.raises(TypeError, match="q, k and v must have the same dtype"):
        jaxdet.attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jaxdet.attention(q.astype(jnp.int32), k, v)
    with pytest.raises(ValueError, match="must divide"):
        jaxdet.attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
    with pytest.raises(ValueError, match="head dimension"):
        jaxdet.attention(q[..., :40], k[..., :40], v[..., :40])
    with pytest.raises(ValueError, match="needs q_positions"):
        jaxdet.attention(q[:, :3], k, v)
    with pytest.raises(ValueError, match="excludes"):
        jaxdet.attention(q, k, v, segment_ids=jnp.zeros((2, 8), jnp.int32), kv_lengths=jnp.asarray([1, 2]))
    with pytest.raises(TypeError, match="q_positions must be an integer array"):
        jaxdet.attention(q, k, v, q_positions=jnp.zeros((2, 8), jnp.float32))
    with pytest.raises(ValueError, match="q_positions must have shape"):
        jaxdet.attention(q, k, v, q_positions=jnp.zeros((3, 8), jnp.int32))
    with pytest.raises(ValueError, match="must be \\[B, T, N, D\\]"):
        jaxdet.attention(q[0], k, v)
    with pytest.raises(ValueError, match="k and v must both be"):
        jaxdet.attention(q, k, v[:, :4])
    with pytest.raises(TypeError, match="causal must be a Python bool"):
        jaxdet.attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="scale must be a static Python float"):
        jax.jit(lambda s: jaxdet.attention(q, k, v, scale=s))(0.5)


# ---- CPU and GPU. ----


@pytest.mark.gpu
def test_gpu_float32_equals_cpu():
    # The float32 GPU kernels follow the CPU order step for step (not a contract; a check that
    # the shared canonical-order code is what both run).
    q, k, v = _qkv(2, 600, 600, 4, 2, 64)
    f = jax.jit(lambda q, k, v: jaxdet.attention(q, k, v))
    a = f(*(jax.device_put(x, jax.devices("cpu")[0]) for x in (q, k, v)))
    b = f(*(jax.device_put(x, jax.devices("gpu")[0]) for x in (q, k, v)))
    assert_bitwise(jax.device_get(a), jax.device_get(b))


# ---- The contract checks of jaxdet report (the same functions). ----


@pytest.mark.parametrize("name,check", contracts.report_checks(), ids=[n for n, _ in contracts.report_checks()])
def test_contract_checks(name, check):
    ok, detail = check()
    assert ok is not False, f"{name}: {detail}"


# Many devices: tests/test_rowops_sharding.py (8 simulated CPU devices).


# ---- Command buffers (GPU). ----


@pytest.mark.gpu
def test_handlers_run_in_command_buffers():
    # Both handlers take their workspace as a result that XLA allocates
    # (cuda/attention/attention_workspace.h), not from its scratch allocator, so they are marked
    # command-buffer compatible: a decode step's kernels replay in one CUDA graph with their
    # neighbours'. The final and split modes and the backward, recorded and replayed, give the bits
    # of the same program run kernel by kernel.
    import command_buffers

    gpu = jax.devices("gpu")[0]
    q, k, v = (jax.device_put(x, gpu) for x in _qkv(2, 256, 256, 8, 2, 128, jnp.bfloat16, seed=11))

    def loss(q, k, v):
        h = jnp.tanh(jaxdet.attention(q, k, v))
        return jnp.sum(jaxdet.attention(h, k, v).astype(jnp.float32) ** 2)

    command_buffers.check_in_command_buffers(
        jax.value_and_grad(loss, argnums=(0, 1, 2)), (q, k, v), ("jaxdet_attention_fwd", "jaxdet_attention_bwd")
    )
    q1, kc, vc = (jax.device_put(x, gpu) for x in _qkv(1, 1, 1100, 8, 2, 128, jnp.bfloat16, seed=12))

    def decode_steps(q, k, v):
        for t in range(4):
            q = jnp.tanh(jaxdet.attention(q, k, v, q_positions=jnp.asarray([1000 + t]))) * 2
        return q

    command_buffers.check_in_command_buffers(decode_steps, (q1, kc, vc), ("jaxdet_attention_fwd",))


@pytest.mark.gpu
def test_split_mode_writes_its_output_over_the_query():
    # In split mode the CUDA forward's output takes q's buffer (every read of q comes before the
    # output's first write), in final mode it does not. A query still needed after the call is
    # copied by XLA first, so its caller sees it unchanged; a jitted loop carrying each step's
    # output as the next step's query (no copy between steps) gives the bits of the steps called
    # one by one.
    gpu = jax.devices("gpu")[0]
    q, kc, vc = (jax.device_put(x, gpu) for x in _qkv(1, 1, 4096, 32, 8, 128, jnp.bfloat16, seed=41))
    pos, n = jax.device_put(jnp.full((1, 1), 4095, jnp.int32), gpu), jax.device_put(jnp.asarray([4096]), gpu)

    def step(q, kc, vc):
        return jaxdet.attention(q, kc, vc, q_positions=pos, kv_lengths=n)

    def aliased(fn, *args):
        return "output_operand_alias" in jax.jit(fn).lower(*args).as_text()

    assert aliased(step, q, kc, vc)
    assert not aliased(jaxdet.attention, *(jax.device_put(x, gpu) for x in _qkv(1, 256, 256, 32, 8, 128, jnp.bfloat16)))
    q_before = np.asarray(q)
    out, q_after = jax.jit(lambda q, kc, vc: (step(q, kc, vc), q))(q, kc, vc)
    assert_bitwise(q_after, q_before)
    assert_bitwise(out, step(q, kc, vc))
    want = q
    for _ in range(3):
        want = step(want, kc, vc)
    loop = jax.jit(lambda q, kc, vc: lax.fori_loop(0, 3, lambda i, x: step(x, kc, vc), q))
    assert_bitwise(loop(q, kc, vc), want)
    assert_bitwise(q, q_before)
    # The backward's residual q survives the forward: the step's dQ is the full causal pass's last row.
    w = _rand((1, 1, 32, 128), seed=42)
    q_full = jnp.concatenate([jax.device_put(_rand((1, 4095, 32, 128), jnp.bfloat16, seed=43), gpu), q], axis=1)

    def loss(fn, q):
        return jnp.sum(fn(q)[:, -1:].astype(jnp.float32) * w)

    dq_step = jax.jit(jax.grad(lambda q: loss(lambda q: step(q, kc, vc), q)))(q)
    dq_full = jax.jit(jax.grad(lambda q: loss(lambda q: jaxdet.attention(q, kc, vc), q)))(q_full)
    assert_bitwise(dq_step, dq_full[:, -1:])


@pytest.mark.gpu
def test_split_mode_under_transformations_keeps_the_direct_bits():
    # The aliased split-mode forward (and its backward) under vmap, jax.checkpoint inside a
    # lax.scan, and jax.shard_map (default check_vma) on a one-GPU mesh, whose per-device call
    # lowers the aliases again from the shard's shapes: outputs and dQ have the direct call's bits.
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    gpu = jax.devices("gpu")[0]
    q, kc, vc = (jax.device_put(x, gpu) for x in _qkv(2, 1, 2048, 32, 8, 128, jnp.bfloat16, seed=51))
    pos = jax.device_put(jnp.asarray([[2047], [1300]], jnp.int32), gpu)
    n = jax.device_put(jnp.asarray([2048, 1301], jnp.int32), gpu)
    w = jax.device_put(_rand((2, 1, 32, 128), seed=52), gpu)

    def step(q, kc, vc, pos, n):
        return jaxdet.attention(q, kc, vc, q_positions=pos, kv_lengths=n)

    def dq_of(fn):
        return jax.jit(jax.grad(lambda q: jnp.sum(fn(q).astype(jnp.float32) * w)))(q)

    want = jax.jit(step)(q, kc, vc, pos, n)
    want_dq = dq_of(lambda q: step(q, kc, vc, pos, n))
    rows = jax.jit(jax.vmap(step))(q[:, None], kc[:, None], vc[:, None], pos[:, None], n[:, None])
    assert_bitwise(rows[:, 0], want)

    def scanned(q):
        body = jax.checkpoint(lambda c, _: (step(c, kc, vc, pos, n), None))
        return lax.scan(body, q, None, length=1)[0]

    assert_bitwise(jax.jit(scanned)(q), want)
    assert_bitwise(dq_of(scanned), want_dq)
    mesh = Mesh(np.asarray([gpu]), ("data",))
    sharded = jax.shard_map(step, mesh=mesh, in_specs=(P("data"),) * 5, out_specs=P("data"))
    assert_bitwise(jax.jit(sharded)(q, kc, vc, pos, n), want)
    assert_bitwise(dq_of(lambda q: sharded(q, kc, vc, pos, n)), want_dq)


# ---- The two tensor-core forward cores (GPU). ----


@pytest.mark.gpu
def test_wgmma_kernels_equal_the_mma_sync_kernels(tmp_path):
    # On a compute capability 9.0 GPU the final-mode forward and the backward (dQ, dK/dV) at head
    # dimensions 64 and 128 run wgmma, the forward in warp-specialized 192-row CTAs (FwdWsKernel);
    # JAXDET_TESTING (read once per process) makes the forward run FwdKernel's one-warpgroup wgmma
    # CTAs (attention=wgmma) or everything run mma.sync (attention=mma), as other GPUs do. The
    # split mode of grids up to a CTA per SM at head dimension 128 runs eight warps per split
    # (DecodeSplitKernel), which merge a tile's splits in a cluster (up to 8 splits) or leave them
    # to CombineKernel (more, or attention=split_combine), FwdKernel's one-warp CTAs under
    # attention=one_warp_splits; attention=eight_warp_splits runs DecodeSplitKernel on grids of
    # any size.
    # Every output and gradient (which reads the forward's lse2) must have the same bits: causal,
    # kv_lengths, packed segments, rows past one split, decode steps and a chunk against a longer
    # cache, packed sequences in split mode, NaN/inf/huge/subnormal/zero inputs.
    if jax.devices("gpu")[0].compute_capability != "9.0":
        pytest.skip("the wgmma kernels run on compute capability 9.0 only")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_cores_worker.py")
    results = {}
    configs = (
        ("specialized", ""),
        ("wgmma", "attention=wgmma"),
        ("mma", "attention=mma"),
        ("one_warp_splits", "attention=one_warp_splits"),
        ("eight_warp_splits", "attention=eight_warp_splits"),
        ("split_combine", "attention=split_combine"),
    )
    for core, testing in configs:
        env = dict(os.environ, JAXDET_TESTING=testing, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        path = tmp_path / f"{core}.npz"
        run = subprocess.run([sys.executable, worker, str(path)], env=env, capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stdout + run.stderr
        results[core] = np.load(path)
    names = results["mma"].files
    # dtypes x head dims x (3 prefill shapes x 4 variants + 5 split shapes x 3 + packed x 2) x 4 arrays
    assert len(names) == 2 * 2 * (3 * 4 + 5 * 3 + 2) * 4
    for core, _ in configs:
        assert results[core].files == names
        differ = [n for n in names if results[core][n].tobytes() != results["mma"][n].tobytes()]
        assert not differ, f"{core}: {len(differ)} of {len(names)} arrays differ from mma.sync's, e.g. {differ[:5]}"


def test_audit_advice_and_docs_point_to_jaxdet_attention():
    """The audit's advice for attention names jaxdet.attention (it exists); user-facing docs cite
    no path on a development machine and no internal roadmap words."""
    q = jnp.ones((2, 16, 4, 8), jnp.float32)
    report = jaxdet.audit(lambda q: jax.nn.dot_product_attention(q, q, q), q, batch_argnums=0)
    found = [f for f in report.findings if f.kind == "attention"]
    assert found and all(f.fix.startswith("jaxdet.attention(q, k, v)") and "Step" not in f.fix for f in found)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pages = [os.path.join(root, "README.md")] + [
        os.path.join(root, "docs", n) for n in os.listdir(os.path.join(root, "docs")) if n.endswith(".md")
    ]
    for page in pages:
        if os.path.basename(page) == "DEVELOPING.md":  # the developers' own tools and machines
            continue
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for pattern in (r"/work/", r"shared/reference", r"\bStep \d", r"\bsessions?\b"):
            assert not re.search(pattern, text), f"{os.path.relpath(page, root)}: {pattern}"
