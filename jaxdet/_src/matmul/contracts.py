"""Invariance facts of jaxdet.matmul for the report, measured on the default device.

``report_checks()`` returns ``[(name, fn)]``; each ``fn()`` returns ``(ok, detail)``. ``ok`` is the
jaxdet property; the jnp.dot figures in ``detail`` are context (what the contract protects against).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxdet
from jaxdet._src.core.testing import assert_bitwise_equal, bits
from jaxdet._src.core.testing import count_bit_differences as _count_diff
from jaxdet._src.matmul.matmul import GEMM_CHUNK, WGRAD_CHUNK_TOKENS, gemm_p

# K, N: not multiples of any register/cache tile, and K above the CPU K block (256).
K, N = 600, 70


def _passes(check, *args, **kwargs):
    """A report check from an assert-style check: (True, detail) or (False, the assertion)."""

    def run():
        try:
            check(*args, **kwargs)
        except AssertionError as err:
            return False, str(err).splitlines()[0][:300]
        return True, (check.__doc__ or check.__name__).strip().splitlines()[0]

    return run


def rand(shape, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def check_row_invariance_forward(dtype, k=K, n=N, m=512):
    """A row alone, in chunks, after padding rows, permuted and with batch dims: the same bits."""
    a = rand((m, k), dtype, 1)
    b = rand((k, n), dtype, 2)
    full = jaxdet.matmul(a, b)
    for i in (0, 1, 137, m - 1):
        assert_bitwise_equal(jaxdet.matmul(a[i : i + 1], b), full[i : i + 1])
    # chunked prefill: pieces of any size, concatenated
    pieces = [a[:100], a[100:101], a[101:300], a[300:]]
    assert_bitwise_equal(jnp.concatenate([jaxdet.matmul(p, b) for p in pieces]), full)
    # padding rows (zeros and random rows) after the real ones
    padded = jnp.concatenate([a[:100], jnp.zeros((28, k), dtype), rand((100, k), dtype, 3)])
    assert_bitwise_equal(jaxdet.matmul(padded, b)[:100], full[:100])
    # permuted rows
    perm = np.random.default_rng(4).permutation(m)
    assert_bitwise_equal(jaxdet.matmul(a[perm], b), full[perm])
    # batch dims fold into M: same rows, same bits
    assert_bitwise_equal(jaxdet.matmul(a.reshape(4, m // 4, k), b).reshape(m, n), full)
    # float32 output for half inputs: row invariant too
    if dtype != jnp.float32:
        f = jaxdet.matmul(a, b, preferred_element_type=jnp.float32)
        assert_bitwise_equal(jaxdet.matmul(a[7:8], b, preferred_element_type=jnp.float32), f[7:8])


def _da(a, b, g):
    _, vjp = jax.vjp(lambda x: jaxdet.matmul(x, b), a)
    return vjp(g)[0]


def check_row_invariance_da(dtype, k=K, n=N, m=512):
    a = rand((m, k), dtype, 5)
    b = rand((k, n), dtype, 6)
    g = rand((m, n), dtype, 7)
    full = _da(a, b, g)
    for i in (0, 255, m - 1):
        assert_bitwise_equal(_da(a[i : i + 1], b, g[i : i + 1]), full[i : i + 1])
    assert_bitwise_equal(jnp.concatenate([_da(a[:100], b, g[:100]), _da(a[100:], b, g[100:])]), full)
    perm = np.random.default_rng(8).permutation(m)
    assert_bitwise_equal(_da(a[perm], b, g[perm]), full[perm])


def _db(a, b, g):
    _, vjp = jax.vjp(lambda w: jaxdet.matmul(a, w), b)
    return vjp(g)[0]


def check_db_contract(dtype, k=64, n=48):
    c = WGRAD_CHUNK_TOKENS
    t = 2 * c + 300
    a = rand((t, k), dtype, 9)
    b = rand((k, n), dtype, 10)
    g = rand((t, n), dtype, 11)
    full = _db(a, b, g)
    # run to run
    assert_bitwise_equal(_db(a, b, g), full)
    # appended zero rows (padding tokens), within the last chunk and crossing into a new one
    for pad in (5, c):
        ap = jnp.concatenate([a, jnp.zeros((pad, k), dtype)])
        gp = jnp.concatenate([g, jnp.zeros((pad, n), dtype)])
        assert_bitwise_equal(_db(ap, b, gp), full)
    # one chunk (on the GPU the cast to the weight's dtype happens in the GEMM's epilogue), and the
    # same tokens padded with zero rows into a second chunk (the last chunk's epilogue adds and casts)
    one = _db(a[: c - 3], b, g[: c - 3])
    assert_bitwise_equal(one, jaxdet.matmul_weight_grad(a[: c - 3], g[: c - 3]).astype(dtype))
    ap = jnp.concatenate([a[: c - 3], jnp.zeros((10, k), dtype)])
    gp = jnp.concatenate([g[: c - 3], jnp.zeros((10, n), dtype)])
    assert_bitwise_equal(_db(ap, b, gp), one)
    # micro-batches of multiples of WGRAD_CHUNK_TOKENS, accumulated with matmul_weight_grad
    acc = None
    for lo, hi in ((0, c), (c, 2 * c), (2 * c, t)):
        acc = jaxdet.matmul_weight_grad(a[lo:hi], g[lo:hi], acc)
    assert_bitwise_equal(acc.astype(dtype), full)
    acc2 = jaxdet.matmul_weight_grad(a[: 2 * c], g[: 2 * c])
    acc2 = jaxdet.matmul_weight_grad(a[2 * c :], g[2 * c :], acc2)
    assert_bitwise_equal(acc2, acc)
    # the full-batch accumulator is the same float32 value
    assert_bitwise_equal(jaxdet.matmul_weight_grad(a, g), acc)
    # a batch dim on a folds into tokens (row-major), exactly like the flattened call
    a3 = a[: 2 * c].reshape(2, c, k)
    g3 = g[: 2 * c].reshape(2, c, n)
    assert_bitwise_equal(_db(a3, b, g3), _db(a[: 2 * c], b, g[: 2 * c]))


def _tree_reference(parts):
    """docs/matmul.md's tree in NumPy float32: pairs level by level, an odd last one carried up."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def check_db_chunk_tree(dtype, k=20, n=12):
    """dB is the canonical tree over chunk partials; micro-batches combined with tree_sum match.

    More than 3 chunks: the canonical tree over chunk partials; micro-batches of 2^j chunks
    combined with jaxdet.parallel.tree_sum, zero padding into new chunks, acc added once."""
    from jaxdet._src.core.tree import tree_sum

    c = WGRAD_CHUNK_TOKENS
    a = rand((8 * c, k), dtype, 40)
    b = rand((k, n), dtype, 41)
    g = rand((8 * c, n), dtype, 42)
    for t in (4 * c, 5 * c - 77, 8 * c):
        chunks = -(-t // c)
        full = _db(a[:t], b, g[:t])
        f32 = jaxdet.matmul_weight_grad(a[:t], g[:t])
        assert_bitwise_equal(f32.astype(dtype), full)
        partials = [
            np.asarray(jaxdet.matmul_weight_grad(a[lo : min(lo + c, t)], g[lo : min(lo + c, t)]))
            for lo in range(0, t, c)
        ]
        assert_bitwise_equal(f32, _tree_reference(partials))
        # the tree is not the left fold (else this test would not tell them apart)
        fold = partials[0]
        for p in partials[1:]:
            fold = fold + p
        assert not np.array_equal(bits(fold), bits(f32))
        # micro-batches of 2^j chunks (the last one shorter), combined by tree_sum
        for j in (0, 1, 2):
            mb = (1 << j) * c
            parts = [
                jaxdet.matmul_weight_grad(a[lo : min(lo + mb, t)], g[lo : min(lo + mb, t)]) for lo in range(0, t, mb)
            ]
            assert_bitwise_equal(tree_sum(parts), f32)
        # zero rows appended, inside the last chunk and adding new chunks (up to the next power of two and past it)
        for pad in (5, c, (8 - chunks) * c + 3):
            ap = jnp.concatenate([a[:t], jnp.zeros((pad, k), dtype)])
            gp = jnp.concatenate([g[:t], jnp.zeros((pad, n), dtype)])
            assert_bitwise_equal(_db(ap, b, gp), full)
        # acc is added once, after the tree
        acc = rand((k, n), jnp.float32, 43)
        assert_bitwise_equal(jaxdet.matmul_weight_grad(a[:t], g[:t], acc), acc + f32)
        # jit and a batch dim folded into tokens give the same bits
        assert_bitwise_equal(jax.jit(_db)(a[:t], b, g[:t]), full)
    a3, g3 = a.reshape(4, 2 * c, k), g.reshape(4, 2 * c, n)
    assert_bitwise_equal(_db(a3, b, g3), _db(a, b, g))


def _gemm(a, b, chunk, out_dtype, transpose_b=False):
    """The jaxdet_gemm primitive: a [L, M, K] . op(b), b [Lb, K, N] (or [Lb, N, K]), chunks of `chunk`."""
    return gemm_p.bind(a, b, transpose_a=False, transpose_b=transpose_b, out_dtype=np.dtype(out_dtype), chunk=chunk)


def _short_chunk(chunk):
    """A last chunk shorter than `chunk`, a multiple of 8 (bf16/f16 rows stay 16-byte aligned on the GPU)."""
    return max(8, chunk // 3 // 8 * 8)


def _chunk_tree_of(a, b, chunk, transpose_b):
    """The rule computed from its parts: the float32 product of each chunk of K alone (the same
    primitive, one chunk), combined by the NumPy tree."""
    K = a.shape[-1]
    parts = []
    for lo in range(0, K, chunk):
        hi = min(lo + chunk, K)
        bk = b[..., lo:hi] if transpose_b else b[:, lo:hi]
        parts.append(np.asarray(_gemm(a[..., lo:hi], bk, chunk, jnp.float32, transpose_b)))
    return _tree_reference(parts)


def check_gemm_chunk_rule(dtype, chunk=64, m=5, n=24, counts=(2, 3, 4, 5, 8)):
    """The GEMM is the canonical tree of its K chunks' float32 partials, cast once.

    For 2, 3, 4, 5 and 8 chunks, whole and with a short last one; a batched and a shared b,
    b read transposed; the result in the input dtype and in float32. The tree is not the single
    fold over K (so this check can fail)."""
    out_dtype = np.dtype(dtype)
    for count in counts:
        for last in (chunk, _short_chunk(chunk)):
            k = (count - 1) * chunk + last
            a = rand((2, m, k), dtype, 60 + count)
            b = rand((2, k, n), dtype, 70 + count)
            for bb, transpose_b in ((b, False), (b[:1], False), (jnp.swapaxes(b, 1, 2), True)):
                tree = _chunk_tree_of(a, bb, chunk, transpose_b)
                assert_bitwise_equal(_gemm(a, bb, chunk, dtype, transpose_b), tree.astype(out_dtype))
                if out_dtype != np.dtype(np.float32):
                    assert_bitwise_equal(_gemm(a, bb, chunk, jnp.float32, transpose_b), tree)
            fold = np.asarray(_gemm(a, b, -(-k // 64) * 64, jnp.float32))
            assert not np.array_equal(bits(fold), bits(_chunk_tree_of(a, b, chunk, False))), (
                f"{count} chunks: the tree equals the single fold, so the check cannot tell them apart"
            )


def check_gemm_appended_zeros(dtype, chunk=64, m=5, n=24):
    """Zeros appended to K change no bit: inside the last chunk, and adding whole new chunks
    (5 chunks become 6, 8 and 10)."""
    k = 4 * chunk + _short_chunk(chunk)
    a = rand((1, m, k), dtype, 80)
    b = rand((1, k, n), dtype, 81)
    for out_dtype in (dtype, jnp.float32):
        ref = _gemm(a, b, chunk, out_dtype)
        for padded in (5 * chunk, 6 * chunk - 8, 8 * chunk, 9 * chunk + 8):
            ap = jnp.pad(a, ((0, 0), (0, 0), (0, padded - k)))
            bp = jnp.pad(b, ((0, 0), (0, padded - k), (0, 0)))
            assert_bitwise_equal(_gemm(ap, bp, chunk, out_dtype), ref)
            assert_bitwise_equal(_gemm(ap, jnp.swapaxes(bp, 1, 2), chunk, out_dtype, True), ref)


def check_matmul_chunk_rule(dtype, m=3, n=16):
    """jaxdet.matmul with K = 2 * GEMM_CHUNK + 300 (three chunks, the last short) is the tree of
    the matmuls of its chunks in float32, (p0 + p1) + p2, cast once."""
    c = GEMM_CHUNK
    k = 2 * c + 300
    a = rand((m, k), dtype, 90)
    b = rand((k, n), dtype, 91)
    parts = [
        np.asarray(jaxdet.matmul(a[:, lo : lo + c], b[lo : lo + c], preferred_element_type=jnp.float32))
        for lo in range(0, k, c)
    ]
    tree = (parts[0] + parts[1]) + parts[2]
    assert_bitwise_equal(jaxdet.matmul(a, b), tree.astype(np.dtype(dtype)))
    assert_bitwise_equal(jaxdet.matmul(a, b, preferred_element_type=jnp.float32), tree)


def check_rows_around_warpgroup_boundaries(dtype, k=1024, n=512):
    """Row counts around the Hopper tile's boundaries (128 rows per tile, 64 per consumer
    warpgroup): every row keeps its bits, whatever part of a tile it fills."""
    m = 300
    a = rand((m, k), dtype, 17)
    b = rand((k, n), dtype, 18)
    g = rand((m, n), dtype, 19)
    full = jaxdet.matmul(a, b)
    full_da = _da(a, b, g)
    for rows in (1, 2, 63, 64, 65, 127, 128, 129, 192, 193):
        assert_bitwise_equal(jaxdet.matmul(a[:rows], b), full[:rows])
        assert_bitwise_equal(jaxdet.matmul(a[m - rows :], b), full[m - rows :])
        assert_bitwise_equal(_da(a[:rows], b, g[:rows]), full_da[:rows])
    # a batched b (one GEMM per batch element) with few rows each
    bs = rand((2, k, n), dtype, 20)
    a2 = a[:200].reshape(2, 100, k)
    batched = jaxdet.matmul(a2, bs)
    for rows in (1, 64, 65):
        assert_bitwise_equal(jaxdet.matmul(a2[:, :rows], bs), batched[:, :rows])
    # the weight gradient's rows are a's columns: the same rows of dB with fewer columns of a
    tokens = 200
    db = jaxdet.matmul_weight_grad(a[:tokens], g[:tokens])
    for cols in (8, 64, 72, 128, 136):
        assert_bitwise_equal(jaxdet.matmul_weight_grad(a[:tokens, :cols], g[:tokens]), db[:cols])


def check_vmap(dtype):
    a = rand((3, 40, K), dtype, 12)
    b = rand((K, N), dtype, 13)
    bs = rand((3, K, N), dtype, 14)
    loop = jnp.stack([jaxdet.matmul(a[i], b) for i in range(3)])
    assert_bitwise_equal(jax.vmap(jaxdet.matmul, in_axes=(0, None))(a, b), loop)
    loop_b = jnp.stack([jaxdet.matmul(a[i], bs[i]) for i in range(3)])
    assert_bitwise_equal(jax.vmap(jaxdet.matmul)(a, bs), loop_b)
    loop_bo = jnp.stack([jaxdet.matmul(a[0], bs[i]) for i in range(3)])
    assert_bitwise_equal(jax.vmap(jaxdet.matmul, in_axes=(None, 0))(a[0], bs), loop_bo)
    # vmap axis not at 0, and nested under jit
    a_t = jnp.moveaxis(a, 0, 1)
    assert_bitwise_equal(jax.jit(jax.vmap(jaxdet.matmul, in_axes=(1, None)))(a_t, b), loop)
    # vmap of the backward (per-example gradients) equals the per-example loop
    f = lambda x, w: jnp.sum(jaxdet.matmul(x, w).astype(jnp.float32) ** 2)
    gv = jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(0, None))(a, b)
    for i in range(3):
        gi = jax.grad(f, argnums=(0, 1))(a[i], b)
        assert_bitwise_equal(gv[0][i], gi[0])
        assert_bitwise_equal(gv[1][i], gi[1])


def check_jit_vs_eager(dtype):
    a = rand((33, K), dtype, 15)
    b = rand((K, N), dtype, 16)
    assert_bitwise_equal(jax.jit(jaxdet.matmul)(a, b), jaxdet.matmul(a, b))
    f = lambda x, w: jnp.sum(jaxdet.matmul(x, w).astype(jnp.float32) * 0.5)
    ge = jax.grad(f, argnums=(0, 1))(a, b)
    gj = jax.jit(jax.grad(f, argnums=(0, 1)))(a, b)
    assert_bitwise_equal(gj[0], ge[0])
    assert_bitwise_equal(gj[1], ge[1])
    # inside a bigger jitted computation, fused neighbours do not change the rows
    big = jax.jit(lambda x, w: jaxdet.matmul(x * 1.0, w) + 0.0)(a, b)
    assert_bitwise_equal(big, jaxdet.matmul(a, b))


def _rand(shape, dtype, seed):
    return rand(shape, dtype, seed)


def _jnp_matmul(a, b):
    return jnp.matmul(a, b)


def _da_with(mm, a, b, g):
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
                full, one = _da_with(mm, a, b, g)[:1], _da_with(mm, a[:1], b, g[:1])
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
        (
            "matmul rows: alone, chunked, padded, permuted, batched (bf16)",
            _passes(check_row_invariance_forward, jnp.bfloat16),
        ),
        ("matmul rows around tile boundaries (bf16)", _passes(check_rows_around_warpgroup_boundaries, jnp.bfloat16)),
        ("matmul dB micro-batch accumulation bitwise", _db_microbatch),
        ("matmul dB unchanged by appended zero rows", _db_padding),
        ("matmul dB canonical chunk tree (bf16)", _passes(check_db_chunk_tree, jnp.bfloat16)),
        ("matmul K chunks by the canonical tree (bf16)", _passes(check_gemm_chunk_rule, jnp.bfloat16)),
        ("matmul vmap equals per-example calls", _vmap_loop),
    ]
