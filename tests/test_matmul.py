"""jaxdet.matmul: row invariance (forward and dA), the dB chunk contract, vmap/jit, accuracy, errors.

Every contract in docs/matmul.md names the test here that proves it. The invariance checks are
written once (`check_*` helpers) and run on the CPU and, marked `gpu`, on the GPU.
"""

import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxdet
from bitwise import assert_bitwise, bits
from jaxdet import _native
from jaxdet.matmul import WGRAD_CHUNK_TOKENS, gemm_p, wgrad_p

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]
# K, N: not multiples of any register/cache tile, and K above the CPU K block (256).
K, N = 600, 70




def rand(shape, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


# ---- The checks, shared by the CPU tests and the GPU tests. ----

def check_row_invariance_forward(dtype, k=K, n=N, m=512):
    a = rand((m, k), dtype, 1)
    b = rand((k, n), dtype, 2)
    full = jaxdet.matmul(a, b)
    for i in (0, 1, 137, m - 1):
        assert_bitwise(jaxdet.matmul(a[i : i + 1], b), full[i : i + 1])
    # chunked prefill: pieces of any size, concatenated
    pieces = [a[:100], a[100:101], a[101:300], a[300:]]
    assert_bitwise(jnp.concatenate([jaxdet.matmul(p, b) for p in pieces]), full)
    # padding rows (zeros and random rows) after the real ones
    padded = jnp.concatenate([a[:100], jnp.zeros((28, k), dtype), rand((100, k), dtype, 3)])
    assert_bitwise(jaxdet.matmul(padded, b)[:100], full[:100])
    # permuted rows
    perm = np.random.default_rng(4).permutation(m)
    assert_bitwise(jaxdet.matmul(a[perm], b), full[perm])
    # batch dims fold into M: same rows, same bits
    assert_bitwise(jaxdet.matmul(a.reshape(4, m // 4, k), b).reshape(m, n), full)
    # float32 output for half inputs: row invariant too
    if dtype != jnp.float32:
        f = jaxdet.matmul(a, b, preferred_element_type=jnp.float32)
        assert_bitwise(jaxdet.matmul(a[7:8], b, preferred_element_type=jnp.float32), f[7:8])


def _da(a, b, g):
    _, vjp = jax.vjp(lambda x: jaxdet.matmul(x, b), a)
    return vjp(g)[0]


def check_row_invariance_da(dtype, k=K, n=N, m=512):
    a = rand((m, k), dtype, 5)
    b = rand((k, n), dtype, 6)
    g = rand((m, n), dtype, 7)
    full = _da(a, b, g)
    for i in (0, 255, m - 1):
        assert_bitwise(_da(a[i : i + 1], b, g[i : i + 1]), full[i : i + 1])
    assert_bitwise(jnp.concatenate([_da(a[:100], b, g[:100]), _da(a[100:], b, g[100:])]), full)
    perm = np.random.default_rng(8).permutation(m)
    assert_bitwise(_da(a[perm], b, g[perm]), full[perm])


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
    assert_bitwise(_db(a, b, g), full)
    # appended zero rows (padding tokens), within the last chunk and crossing into a new one
    for pad in (5, c):
        ap = jnp.concatenate([a, jnp.zeros((pad, k), dtype)])
        gp = jnp.concatenate([g, jnp.zeros((pad, n), dtype)])
        assert_bitwise(_db(ap, b, gp), full)
    # one chunk (on the GPU the cast to the weight's dtype happens in the GEMM's epilogue), and the
    # same tokens padded with zero rows into a second chunk (the last chunk's epilogue adds and casts)
    one = _db(a[: c - 3], b, g[: c - 3])
    assert_bitwise(one, jaxdet.matmul_weight_grad(a[: c - 3], g[: c - 3]).astype(dtype))
    ap = jnp.concatenate([a[: c - 3], jnp.zeros((10, k), dtype)])
    gp = jnp.concatenate([g[: c - 3], jnp.zeros((10, n), dtype)])
    assert_bitwise(_db(ap, b, gp), one)
    # micro-batches of multiples of WGRAD_CHUNK_TOKENS, accumulated with matmul_weight_grad
    acc = None
    for lo, hi in ((0, c), (c, 2 * c), (2 * c, t)):
        acc = jaxdet.matmul_weight_grad(a[lo:hi], g[lo:hi], acc)
    assert_bitwise(acc.astype(dtype), full)
    acc2 = jaxdet.matmul_weight_grad(a[: 2 * c], g[: 2 * c])
    acc2 = jaxdet.matmul_weight_grad(a[2 * c :], g[2 * c :], acc2)
    assert_bitwise(acc2, acc)
    # the full-batch accumulator is the same float32 value
    assert_bitwise(jaxdet.matmul_weight_grad(a, g), acc)
    # a batch dim on a folds into tokens (row-major), exactly like the flattened call
    a3 = a[: 2 * c].reshape(2, c, k)
    g3 = g[: 2 * c].reshape(2, c, n)
    assert_bitwise(_db(a3, b, g3), _db(a[: 2 * c], b, g[: 2 * c]))


def _tree_reference(parts):
    """docs/matmul.md's tree in NumPy float32: pairs level by level, an odd last one carried up."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def check_db_chunk_tree(dtype, k=20, n=12):
    """More than 3 chunks: the canonical tree over chunk partials; micro-batches of 2^j chunks
    combined with jaxdet.parallel.tree_sum, zero padding into new chunks, acc added once."""
    from jaxdet.parallel import tree_sum

    c = WGRAD_CHUNK_TOKENS
    a = rand((8 * c, k), dtype, 40)
    b = rand((k, n), dtype, 41)
    g = rand((8 * c, n), dtype, 42)
    for t in (4 * c, 5 * c - 77, 8 * c):
        chunks = -(-t // c)
        full = _db(a[:t], b, g[:t])
        f32 = jaxdet.matmul_weight_grad(a[:t], g[:t])
        assert_bitwise(f32.astype(dtype), full)
        partials = [
            np.asarray(jaxdet.matmul_weight_grad(a[lo : min(lo + c, t)], g[lo : min(lo + c, t)]))
            for lo in range(0, t, c)
        ]
        assert_bitwise(f32, _tree_reference(partials))
        # the tree is not the left fold (else this test would not tell them apart)
        fold = partials[0]
        for p in partials[1:]:
            fold = fold + p
        assert not np.array_equal(bits(fold), bits(f32))
        # micro-batches of 2^j chunks (the last one shorter), combined by tree_sum
        for j in (0, 1, 2):
            mb = (1 << j) * c
            parts = [jaxdet.matmul_weight_grad(a[lo : min(lo + mb, t)], g[lo : min(lo + mb, t)]) for lo in range(0, t, mb)]
            assert_bitwise(tree_sum(parts), f32)
        # zero rows appended, inside the last chunk and adding new chunks (up to the next power of two and past it)
        for pad in (5, c, (8 - chunks) * c + 3):
            ap = jnp.concatenate([a[:t], jnp.zeros((pad, k), dtype)])
            gp = jnp.concatenate([g[:t], jnp.zeros((pad, n), dtype)])
            assert_bitwise(_db(ap, b, gp), full)
        # acc is added once, after the tree
        acc = rand((k, n), jnp.float32, 43)
        assert_bitwise(jaxdet.matmul_weight_grad(a[:t], g[:t], acc), acc + f32)
        # jit and a batch dim folded into tokens give the same bits
        assert_bitwise(jax.jit(_db)(a[:t], b, g[:t]), full)
    a3, g3 = a.reshape(4, 2 * c, k), g.reshape(4, 2 * c, n)
    assert_bitwise(_db(a3, b, g3), _db(a, b, g))


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
        assert_bitwise(jaxdet.matmul(a[:rows], b), full[:rows])
        assert_bitwise(jaxdet.matmul(a[m - rows :], b), full[m - rows :])
        assert_bitwise(_da(a[:rows], b, g[:rows]), full_da[:rows])
    # a batched b (one GEMM per batch element) with few rows each
    bs = rand((2, k, n), dtype, 20)
    a2 = a[:200].reshape(2, 100, k)
    batched = jaxdet.matmul(a2, bs)
    for rows in (1, 64, 65):
        assert_bitwise(jaxdet.matmul(a2[:, :rows], bs), batched[:, :rows])
    # the weight gradient's rows are a's columns: the same rows of dB with fewer columns of a
    tokens = 200
    db = jaxdet.matmul_weight_grad(a[:tokens], g[:tokens])
    for cols in (8, 64, 72, 128, 136):
        assert_bitwise(jaxdet.matmul_weight_grad(a[:tokens, :cols], g[:tokens]), db[:cols])


def check_vmap(dtype):
    a = rand((3, 40, K), dtype, 12)
    b = rand((K, N), dtype, 13)
    bs = rand((3, K, N), dtype, 14)
    loop = jnp.stack([jaxdet.matmul(a[i], b) for i in range(3)])
    assert_bitwise(jax.vmap(jaxdet.matmul, in_axes=(0, None))(a, b), loop)
    loop_b = jnp.stack([jaxdet.matmul(a[i], bs[i]) for i in range(3)])
    assert_bitwise(jax.vmap(jaxdet.matmul)(a, bs), loop_b)
    loop_bo = jnp.stack([jaxdet.matmul(a[0], bs[i]) for i in range(3)])
    assert_bitwise(jax.vmap(jaxdet.matmul, in_axes=(None, 0))(a[0], bs), loop_bo)
    # vmap axis not at 0, and nested under jit
    a_t = jnp.moveaxis(a, 0, 1)
    assert_bitwise(jax.jit(jax.vmap(jaxdet.matmul, in_axes=(1, None)))(a_t, b), loop)
    # vmap of the backward (per-example gradients) equals the per-example loop
    f = lambda x, w: jnp.sum(jaxdet.matmul(x, w).astype(jnp.float32) ** 2)
    gv = jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(0, None))(a, b)
    for i in range(3):
        gi = jax.grad(f, argnums=(0, 1))(a[i], b)
        assert_bitwise(gv[0][i], gi[0])
        assert_bitwise(gv[1][i], gi[1])


def check_jit_vs_eager(dtype):
    a = rand((33, K), dtype, 15)
    b = rand((K, N), dtype, 16)
    assert_bitwise(jax.jit(jaxdet.matmul)(a, b), jaxdet.matmul(a, b))
    f = lambda x, w: jnp.sum(jaxdet.matmul(x, w).astype(jnp.float32) * 0.5)
    ge = jax.grad(f, argnums=(0, 1))(a, b)
    gj = jax.jit(jax.grad(f, argnums=(0, 1)))(a, b)
    assert_bitwise(gj[0], ge[0])
    assert_bitwise(gj[1], ge[1])
    # inside a bigger jitted computation, fused neighbours do not change the rows
    big = jax.jit(lambda x, w: jaxdet.matmul(x * 1.0, w) + 0.0)(a, b)
    assert_bitwise(big, jaxdet.matmul(a, b))


# ---- CPU tests ----

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_invariance_forward(dtype):
    check_row_invariance_forward(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_row_invariance_da(dtype):
    check_row_invariance_da(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_db_padding_and_microbatch_accumulation(dtype):
    check_db_contract(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_db_chunk_tree(dtype):
    check_db_chunk_tree(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_around_warpgroup_boundaries(dtype):
    check_rows_around_warpgroup_boundaries(dtype, k=K, n=N)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_vmap_equals_loop(dtype):
    check_vmap(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_jit_equals_eager(dtype):
    check_jit_vs_eager(dtype)


def test_row_invariance_small_and_large_shapes():
    # N and K below one register tile, and a row alone vs 1000 rows (several M blocks and threads).
    for k, n in ((1, 1), (3, 5), (1024, 33)):
        check_row_invariance_forward(jnp.float32, k=k, n=n, m=512)
    a = rand((1000, 300), jnp.float32, 17)
    b = rand((300, 600), jnp.float32, 18)
    full = jaxdet.matmul(a, b)
    assert_bitwise(jaxdet.matmul(a[999:], b), full[999:])


_VARIANT_RUN = """
import sys
import jax.numpy as jnp
import numpy as np
sys.path.insert(0, {tests!r})
import jaxdet, test_matmul as t
from jaxdet import _native
from jaxdet.testing import assert_bitwise_equal
assert _native.cpu_gemm_isa() == {isa!r}, _native.cpu_gemm_isa()
a, b = t.rand((77, t.K), jnp.float32, 19), t.rand((t.K, t.N), jnp.float32, 20)
full = np.asarray(jaxdet.matmul(a, b))
assert_bitwise_equal(jaxdet.matmul(a[5:6], b), full[5:6])
t.check_row_invariance_da(jnp.bfloat16, k=300, n=40, m=64)
np.save({out!r}, full)
"""


def test_cpu_variants_agree(tmp_path):
    """The AVX-512 and AVX2 (both FMA) variants give the same bits; the portable one is row invariant too.
    One process per variant: JAXDET_TESTING=cpu_gemm=... is read once per process."""
    results = {}
    for isa in _native.cpu_gemm_variants():
        out = tmp_path / f"{isa}.npy"
        code = _VARIANT_RUN.format(tests=os.path.dirname(os.path.abspath(__file__)), isa=isa, out=str(out))
        env = dict(os.environ, JAXDET_TESTING=f"cpu_gemm={isa}")
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        results[isa] = np.load(out)
    assert "generic" in results
    if "avx512" in results and "avx2" in results:
        assert_bitwise(results["avx512"], results["avx2"])


# ---- The primitives' interface (shared with the CUDA kernels) ----

def test_gemm_primitive_transposed_operands_read_in_place():
    a = rand((2, 50, 300), jnp.float32, 21)
    b = rand((2, 300, 40), jnp.float32, 22)
    ref = gemm_p.bind(a, b, transpose_a=False, transpose_b=False, out_dtype=np.dtype(np.float32))
    at = jnp.swapaxes(a, 1, 2)
    bt = jnp.swapaxes(b, 1, 2)
    for x, y, ta, tb in ((at, b, True, False), (a, bt, False, True), (at, bt, True, True)):
        out = gemm_p.bind(x, y, transpose_a=ta, transpose_b=tb, out_dtype=np.dtype(np.float32))
        assert_bitwise(out, ref)
    # Lb = 1 broadcasts b over L
    out = gemm_p.bind(a, b[:1], transpose_a=False, transpose_b=False, out_dtype=np.dtype(np.float32))
    assert_bitwise(out[1], gemm_p.bind(a[1:], b[:1], transpose_a=False, transpose_b=False, out_dtype=np.dtype(np.float32))[0])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_wgrad_primitive_is_the_chunk_sequence(dtype):
    """acc = acc + a[c]^T . dc[c] for each chunk c in order, each chunk a plain GEMM from 0."""
    chunk, t, k, n = 64, 64 * 3 + 17, 40, 24
    acc0 = rand((1, k, n), jnp.float32, 23)
    a = rand((1, t, k), dtype, 24)
    dc = rand((1, t, n), dtype, 25)
    out = wgrad_p.bind(acc0, a, dc, chunk_tokens=chunk)
    ref = np.asarray(acc0)
    for lo in range(0, t, chunk):
        part = gemm_p.bind(a[:, lo : lo + chunk], dc[:, lo : lo + chunk], transpose_a=True, transpose_b=False,
                           out_dtype=np.dtype(np.float32))
        ref = ref + np.asarray(part)  # one float32 add per element
    assert_bitwise(out, ref)
    # empty token range: acc unchanged
    empty = wgrad_p.bind(acc0, a[:, :0], dc[:, :0], chunk_tokens=chunk)
    assert_bitwise(empty, acc0)


# ---- Accuracy, gradients, dtypes, shapes, errors ----

# Relative Frobenius error vs a float64 product of the same (rounded) inputs.
ACCURACY = {
    (jnp.float32, None): 2e-6,
    (jnp.bfloat16, None): 5e-3,  # one bf16 rounding of the output (2^-9)
    (jnp.float16, None): 1e-3,  # one f16 rounding of the output (2^-11)
    (jnp.bfloat16, jnp.float32): 2e-6,
    (jnp.float16, jnp.float32): 2e-6,
}


@pytest.mark.parametrize("dtype,pref", list(ACCURACY), ids=lambda v: getattr(v, "__name__", str(v)))
def test_accuracy_vs_float64(dtype, pref):
    a = rand((3, 50, 700), dtype, 26)
    b = rand((700, 90), dtype, 27)
    out = jaxdet.matmul(a, b, preferred_element_type=pref)
    assert out.dtype == (pref or dtype) and out.shape == (3, 50, 90)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    err = np.linalg.norm(np.asarray(out, np.float64) - ref) / np.linalg.norm(ref)
    assert err < ACCURACY[(dtype, pref)], err


def test_float32_is_true_float32_not_tf32():
    # 1 + 2^-20 survives float32 products; TF32 (10 mantissa bits) would round it to 1.
    a = jnp.full((4, 8), 1.0 + 2.0**-20, jnp.float32)
    b = jnp.ones((8, 3), jnp.float32)
    np.testing.assert_array_equal(np.asarray(jaxdet.matmul(a, b)), np.float32(8 * (1.0 + 2.0**-20)))


def test_batched_b_broadcasts_like_jnp_matmul():
    a = rand((2, 3, 20, 30), jnp.float32, 28)
    b = rand((3, 30, 10), jnp.float32, 29)
    out = jaxdet.matmul(a, b)
    assert out.shape == (2, 3, 20, 10)
    np.testing.assert_allclose(out, np.asarray(a) @ np.asarray(b), rtol=1e-5, atol=1e-5)
    for i in range(2):
        for j in range(3):
            assert_bitwise(out[i, j], jaxdet.matmul(a[i, j], b[j]))
    # a 2-D against a batched b
    out2 = jaxdet.matmul(a[0, 0], b)
    for j in range(3):
        assert_bitwise(out2[j], jaxdet.matmul(a[0, 0], b[j]))
    # b with leading size-1 dims is shared weights
    assert_bitwise(jaxdet.matmul(a, b[:1][None]), jaxdet.matmul(a, b[0])[:, :, :, :])


def test_check_grads_float32():
    a = rand((6, 2, 7), jnp.float32, 30)
    b = rand((7, 5), jnp.float32, 31)
    check_grads(jaxdet.matmul, (a, b), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)
    bb = rand((6, 7, 5), jnp.float32, 32)
    check_grads(jaxdet.matmul, (a[:, 0], bb), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)


def test_gradients_match_jnp_dot():
    a = rand((2, 30, 40), jnp.float32, 33)
    b = rand((40, 20), jnp.float32, 34)
    f = lambda mm: jax.grad(lambda x, w: jnp.sum(jnp.sin(mm(x, w))), argnums=(0, 1))(a, b)
    got = f(jaxdet.matmul)
    want = f(lambda x, w: jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_half_gradients_have_input_dtypes():
    a = rand((5, 16), jnp.bfloat16, 35)
    b = rand((16, 8), jnp.bfloat16, 36)
    da, db = jax.grad(lambda x, w: jnp.sum(jaxdet.matmul(x, w, preferred_element_type=jnp.float32)), argnums=(0, 1))(a, b)
    assert da.dtype == jnp.bfloat16 and db.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "a_shape,b_shape,out_shape",
    [((0, 8), (8, 4), (0, 4)), ((5, 8), (8, 0), (5, 0)), ((5, 0), (0, 4), (5, 4)), ((0, 5, 8), (8, 4), (0, 5, 4)),
     ((2, 0, 8), (2, 8, 4), (2, 0, 4))],
)
def test_zero_size_dims(a_shape, b_shape, out_shape):
    a = jnp.ones(a_shape, jnp.bfloat16)
    b = jnp.ones(b_shape, jnp.bfloat16)
    out = jaxdet.matmul(a, b)
    assert out.shape == out_shape and out.dtype == jnp.bfloat16
    assert not np.any(np.asarray(out, np.float32))
    da, db = jax.grad(lambda x, w: jnp.sum(jaxdet.matmul(x, w).astype(jnp.float32)), argnums=(0, 1))(a, b)
    assert da.shape == a_shape and db.shape == b_shape
    assert jaxdet.matmul_weight_grad(jnp.ones((0, 8)), jnp.ones((0, 4))).shape == (8, 4)


def test_errors():
    f32 = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(TypeError, match="same dtype"):
        jaxdet.matmul(f32, jnp.ones((8, 3), jnp.bfloat16))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jaxdet.matmul(jnp.ones((4, 8), jnp.int32), jnp.ones((8, 3), jnp.int32))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        jaxdet.matmul(np.ones((4, 8), np.float64), np.ones((8, 3), np.float64))
    with pytest.raises(TypeError, match="preferred_element_type"):
        jaxdet.matmul(jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 3), jnp.bfloat16), preferred_element_type=jnp.float16)
    with pytest.raises(TypeError, match="preferred_element_type"):
        jaxdet.matmul(f32, jnp.ones((8, 3)), preferred_element_type=jnp.bfloat16)
    with pytest.raises(TypeError, match="array"):
        jaxdet.matmul([[1.0]], [[1.0]])
    with pytest.raises(ValueError) as info:
        jaxdet.matmul(jnp.ones((2, 4, 8)), jnp.ones((7, 3)))
    assert "[2, 4, 8]" in str(info.value) and "[7, 3]" in str(info.value)
    with pytest.raises(ValueError, match="rank"):
        jaxdet.matmul(jnp.ones((8,)), jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="broadcast"):
        jaxdet.matmul(jnp.ones((2, 4, 8)), jnp.ones((3, 8, 3)))
    with pytest.raises(TypeError, match="same dtype"):
        jaxdet.matmul_weight_grad(f32, jnp.ones((4, 3), jnp.float16))
    with pytest.raises(ValueError, match="token dims"):
        jaxdet.matmul_weight_grad(f32, jnp.ones((5, 3)))
    with pytest.raises(TypeError, match="float32"):
        jaxdet.matmul_weight_grad(f32, jnp.ones((4, 3)), jnp.ones((8, 3), jnp.bfloat16))
    with pytest.raises(ValueError, match="acc must have shape"):
        jaxdet.matmul_weight_grad(f32, jnp.ones((4, 3)), jnp.ones((3, 8)))


def test_chunk_size_constant():
    assert jaxdet.WGRAD_CHUNK_TOKENS == jaxdet.matmul.WGRAD_CHUNK_TOKENS == 8192


# ---- GPU: the same invariance checks on the GPU device (`pytest -m gpu`) ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_row_invariance_forward_and_da(dtype, gpu):
    with jax.default_device(gpu):
        check_row_invariance_forward(dtype, k=4096, n=512, m=1024)
        check_row_invariance_forward(dtype)
        check_row_invariance_da(dtype)
        check_rows_around_warpgroup_boundaries(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_db_contract(dtype, gpu):
    with jax.default_device(gpu):
        check_db_contract(dtype)
        check_db_chunk_tree(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_vmap_and_jit(dtype, gpu):
    with jax.default_device(gpu):
        check_vmap(dtype)
        check_jit_vs_eager(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,pref", list(ACCURACY), ids=lambda v: getattr(v, "__name__", str(v)))
def test_gpu_accuracy_vs_float64(dtype, pref, gpu):
    with jax.default_device(gpu):
        test_accuracy_vs_float64(dtype, pref)


def test_report_facts_hold_on_cpu():
    from jaxdet._facts_matmul import report_checks

    for name, fn in report_checks():
        ok, detail = fn()
        assert ok, f"{name}: {detail}"
