"""Invariance facts of jaxdet.matmul for the report, measured on the default device.

``report_checks()`` returns ``[(name, fn)]``; each ``fn()`` returns ``(ok, detail)``. ``ok`` is the
jaxdet property; the jnp.dot figures in ``detail`` are context (what the contract protects against).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet
from jaxdet.matmul import WGRAD_CHUNK_TOKENS
from jaxdet.testing import count_bit_differences as _count_diff


def _rand(shape, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def _jnp_matmul(a, b):
    return jnp.matmul(a, b)


def _da(mm, a, b, g):
    return jax.vjp(lambda x: mm(x, b), a)[1](g)[0]


def _row_check(dtype, which, k=1024, n=512, m=512):
    def fn():
        a = _rand((m, k), dtype, 1)
        b = _rand((k, n), dtype, 2)
        g = _rand((m, n), dtype, 3)
        counts = {}
        for label, mm in (("jnp.dot", _jnp_matmul), ("jaxdet", jaxdet.matmul)):
            if which == "fwd":
                full, one = mm(a, b)[:1], mm(a[:1], b)
            else:
                full, one = _da(mm, a, b, g)[:1], _da(mm, a[:1], b, g[:1])
            counts[label] = _count_diff(one, full)
        width = n if which == "fwd" else k
        detail = (
            f"row 0 elements whose bits differ, M=1 vs M={m} ({jnp.dtype(dtype).name}, K={k}, N={n}): "
            f"jnp.dot {counts['jnp.dot']}/{width}, jaxdet {counts['jaxdet']}/{width}"
        )
        return counts["jaxdet"] == 0, detail

    return fn


def _db_microbatch():
    c = WGRAD_CHUNK_TOKENS
    t, k, n = 3 * c, 128, 64
    a = _rand((t, k), jnp.bfloat16, 4)
    g = _rand((t, n), jnp.bfloat16, 5)
    w = _rand((k, n), jnp.bfloat16, 6)
    full = jax.vjp(lambda x: jaxdet.matmul(a, x), w)[1](g)[0]
    acc = None
    for lo in range(0, t, c):
        acc = jaxdet.matmul_weight_grad(a[lo : lo + c], g[lo : lo + c], acc)
    diff = _count_diff(acc.astype(jnp.bfloat16), full)
    # jnp: per-micro-batch dW summed in float32 vs one full-batch dW
    jfull = jax.vjp(lambda x: jnp.matmul(a, x, preferred_element_type=jnp.float32), w)[1](g.astype(jnp.float32))[0]
    jacc = sum(
        jax.vjp(lambda x, lo=lo: jnp.matmul(a[lo : lo + c], x, preferred_element_type=jnp.float32), w)[1](
            g[lo : lo + c].astype(jnp.float32)
        )[0].astype(jnp.float32)
        for lo in range(0, t, c)
    )
    jdiff = _count_diff(jnp.asarray(jacc, jnp.float32).astype(jnp.bfloat16), jfull.astype(jnp.bfloat16))
    return diff == 0, (
        f"bf16 dB, {t} tokens as 3 micro-batches of WGRAD_CHUNK_TOKENS={c} accumulated with "
        f"matmul_weight_grad vs one full-batch grad: jaxdet {diff}/{k * n} elements differ "
        f"(jnp.dot with summed micro-batch grads: {jdiff}/{k * n})"
    )


def _db_padding():
    t, k, n = 1000, 128, 64
    a = _rand((t, k), jnp.float32, 7)
    g = _rand((t, n), jnp.float32, 8)
    w = _rand((k, n), jnp.float32, 9)
    pad = 3000  # crosses a chunk boundary
    ap = jnp.concatenate([a, jnp.zeros((pad, k), a.dtype)])
    gp = jnp.concatenate([g, jnp.zeros((pad, n), g.dtype)])
    counts = {}
    for label, mm in (("jnp.dot", _jnp_matmul), ("jaxdet", jaxdet.matmul)):
        d0 = jax.vjp(lambda x: mm(a, x), w)[1](g)[0]
        d1 = jax.vjp(lambda x: mm(ap, x), w)[1](gp)[0]
        counts[label] = _count_diff(d0, d1)
    return counts["jaxdet"] == 0, (
        f"f32 dB with {pad} zero rows appended to {t} tokens: jaxdet {counts['jaxdet']}/{k * n} elements "
        f"differ (jnp.dot {counts['jnp.dot']}/{k * n})"
    )


def _vmap_loop():
    a = _rand((4, 33, 256), jnp.bfloat16, 10)
    b = _rand((4, 256, 96), jnp.bfloat16, 11)
    loop = jnp.stack([jaxdet.matmul(a[i], b[0]) for i in range(4)])
    loop_b = jnp.stack([jaxdet.matmul(a[i], b[i]) for i in range(4)])
    d1 = _count_diff(jax.vmap(jaxdet.matmul, in_axes=(0, None))(a, b[0]), loop)
    d2 = _count_diff(jax.jit(jax.vmap(jaxdet.matmul))(a, b), loop_b)
    return d1 == 0 and d2 == 0, f"vmap (shared b / batched b, jit) vs per-example calls: {d1} and {d2} elements differ"


def report_checks():
    return [
        ("matmul forward row invariance f32 (M=1 vs 512)", _row_check(jnp.float32, "fwd")),
        ("matmul forward row invariance bf16 (M=1 vs 512)", _row_check(jnp.bfloat16, "fwd")),
        ("matmul dA row invariance f32 (M=1 vs 512)", _row_check(jnp.float32, "da")),
        ("matmul dA row invariance bf16 (M=1 vs 512)", _row_check(jnp.bfloat16, "da")),
        ("matmul dB micro-batch accumulation bitwise", _db_microbatch),
        ("matmul dB unchanged by appended zero rows", _db_padding),
        ("matmul vmap equals per-example calls", _vmap_loop),
    ]
