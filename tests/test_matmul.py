"""jaxdet.matmul: row invariance (forward and dA), the dB chunk contract, vmap/jit, accuracy, errors.

Every contract in docs/matmul.md names the test here that proves it. The invariance checks are
written once, in jaxdet._src.matmul.contracts (the report runs them too), and run here on the CPU and,
marked `gpu`, on the GPU.
"""

import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from checks import DTYPE_IDS, DTYPES
from jax.test_util import check_grads

import jaxdet
from jaxdet import _native
from jaxdet._src.matmul import contracts
from jaxdet._src.matmul.matmul import GEMM_CHUNK, gemm_p, wgrad_p

# K, N: not multiples of any register/cache tile, and K above the CPU K block (256).
K, N = 600, 70


rand = contracts.rand
check_row_invariance_forward = contracts.check_row_invariance_forward
check_row_invariance_da = contracts.check_row_invariance_da
check_db_contract = contracts.check_db_contract
check_db_chunk_tree = contracts.check_db_chunk_tree
check_rows_around_warpgroup_boundaries = contracts.check_rows_around_warpgroup_boundaries
check_vmap = contracts.check_vmap
check_jit_vs_eager = contracts.check_jit_vs_eager
_da, _db = contracts._da, contracts._db


# ---- CPU tests ----


CPU_CONTRACTS = {
    "row_invariance_forward": check_row_invariance_forward,
    "row_invariance_da": check_row_invariance_da,
    "db_padding_and_microbatch_accumulation": check_db_contract,
    "db_chunk_tree": check_db_chunk_tree,
    "rows_around_warpgroup_boundaries": lambda dtype: check_rows_around_warpgroup_boundaries(dtype, k=K, n=N),
    "vmap_equals_loop": check_vmap,
    "jit_equals_eager": check_jit_vs_eager,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("contract", list(CPU_CONTRACTS))
def test_contract_on_cpu(contract, dtype):
    CPU_CONTRACTS[contract](dtype)


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
        r = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tempfile.gettempdir(),
        )
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
        results[isa] = np.load(out)
    assert "generic" in results
    if "avx512" in results and "avx2" in results:
        assert_bitwise(results["avx512"], results["avx2"])


# ---- The primitives' interface (shared with the CUDA kernels) ----


def test_gemm_primitive_transposed_operands_read_in_place():
    a = rand((2, 50, 300), jnp.float32, 21)
    b = rand((2, 300, 40), jnp.float32, 22)
    ref = gemm_p.bind(a, b, transpose_a=False, transpose_b=False, out_dtype=np.dtype(np.float32), chunk=GEMM_CHUNK)
    at = jnp.swapaxes(a, 1, 2)
    bt = jnp.swapaxes(b, 1, 2)
    for x, y, ta, tb in ((at, b, True, False), (a, bt, False, True), (at, bt, True, True)):
        out = gemm_p.bind(x, y, transpose_a=ta, transpose_b=tb, out_dtype=np.dtype(np.float32), chunk=GEMM_CHUNK)
        assert_bitwise(out, ref)
    # Lb = 1 broadcasts b over L
    out = gemm_p.bind(a, b[:1], transpose_a=False, transpose_b=False, out_dtype=np.dtype(np.float32), chunk=GEMM_CHUNK)
    assert_bitwise(
        out[1],
        gemm_p.bind(
            a[1:], b[:1], transpose_a=False, transpose_b=False, out_dtype=np.dtype(np.float32), chunk=GEMM_CHUNK
        )[0],
    )


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
        part = gemm_p.bind(
            a[:, lo : lo + chunk],
            dc[:, lo : lo + chunk],
            transpose_a=True,
            transpose_b=False,
            out_dtype=np.dtype(np.float32),
            chunk=GEMM_CHUNK,
        )
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
    da, db = jax.grad(lambda x, w: jnp.sum(jaxdet.matmul(x, w, preferred_element_type=jnp.float32)), argnums=(0, 1))(
        a, b
    )
    assert da.dtype == jnp.bfloat16 and db.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "a_shape,b_shape,out_shape",
    [
        ((0, 8), (8, 4), (0, 4)),
        ((5, 8), (8, 0), (5, 0)),
        ((5, 0), (0, 4), (5, 4)),
        ((0, 5, 8), (8, 4), (0, 5, 4)),
        ((2, 0, 8), (2, 8, 4), (2, 0, 4)),
    ],
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
        jaxdet.matmul(
            jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 3), jnp.bfloat16), preferred_element_type=jnp.float16
        )
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
    assert jaxdet.GEMM_CHUNK == jaxdet.matmul.GEMM_CHUNK == 8192
    assert jaxdet.WGRAD_CHUNK_TOKENS == jaxdet.matmul.WGRAD_CHUNK_TOKENS == jaxdet.GEMM_CHUNK


# ---- GPU: the same invariance checks on the GPU device (`pytest -m gpu`) ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_row_invariance_forward_and_da(dtype, on_gpu):
    check_row_invariance_forward(dtype, k=4096, n=512, m=1024)
    check_row_invariance_forward(dtype)
    check_row_invariance_da(dtype)
    check_rows_around_warpgroup_boundaries(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_db_contract(dtype, on_gpu):
    check_db_contract(dtype)
    check_db_chunk_tree(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_vmap_and_jit(dtype, on_gpu):
    check_vmap(dtype)
    check_jit_vs_eager(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,pref", list(ACCURACY), ids=lambda v: getattr(v, "__name__", str(v)))
def test_gpu_accuracy_vs_float64(dtype, pref, on_gpu):
    test_accuracy_vs_float64(dtype, pref)


# ---- Higher derivatives: the backward is made of the same custom_vjp products (the product is
# bilinear), so reverse-over-reverse works: gradient penalties, Hessian-vector products. ----


def _f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def _rel(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(x - ref) / np.linalg.norm(ref)


def _penalty(mm, w, x):
    """A gradient penalty: the squared norm of d loss / dx, a function of w and x."""
    gx = jax.grad(lambda x: jnp.sum(jnp.sin(mm(x, w))))(x)
    return jnp.sum(gx * gx)


@pytest.mark.parametrize("batched_b", [False, True], ids=["shared_b", "batched_b"])
def test_grad_of_grad_matches_float64(batched_b):
    x = rand((3, 5, 40), jnp.float32, 30)
    w = rand((3, 40, 24) if batched_b else (40, 24), jnp.float32, 31) / 4
    got = jax.grad(_penalty, argnums=(1, 2))(jaxdet.matmul, w, x)
    with jax.enable_x64(True):
        ref = jax.grad(_penalty, argnums=(1, 2))(jnp.matmul, *_f64(w, x))
    for g, r in zip(got, ref):
        assert g.dtype == jnp.float32
        assert _rel(g, r) < 1e-5, _rel(g, r)
    # A Hessian-vector product, reverse over reverse (jaxdet.matmul is reverse-mode only).
    loss = lambda mm, w: jnp.sum(jnp.sin(mm(x, w)))
    v = rand(w.shape, jnp.float32, 32)
    hvp = lambda mm, w, v: jax.grad(lambda w: jnp.vdot(jax.grad(lambda w: loss(mm, w))(w), v))(w)
    with jax.enable_x64(True):
        x64 = np.asarray(x, np.float64)
        ref = jax.grad(
            lambda w: jnp.vdot(jax.grad(lambda w: jnp.sum(jnp.sin(jnp.matmul(x64, w))))(w), np.asarray(v, np.float64))
        )(np.asarray(w, np.float64))
    assert _rel(hvp(jaxdet.matmul, w, v), ref) < 1e-5


def test_check_grads_second_order():
    x = rand((4, 6, 16), jnp.float32, 33)
    w = rand((16, 8), jnp.float32, 34)
    f = lambda x, w: jnp.sum(jaxdet.matmul(x, w) ** 2)  # quartic: central differences are exact enough
    check_grads(f, (x, w), order=2, modes=["rev"], eps=1e-2, atol=1e-2, rtol=1e-2)
    check_grads(
        lambda x, w: jnp.sum(jaxdet.matmul(x, w, preferred_element_type=jnp.float32) ** 2),
        (x, w[None].repeat(4, 0)),
        order=2,
        modes=["rev"],
        eps=1e-2,
        atol=1e-2,
        rtol=1e-2,
    )


def test_second_derivatives_are_jaxdet_products_in_every_dtype():
    for dtype in DTYPES:
        x = rand((2, 7, 24), dtype, 35)
        w = rand((24, 16), dtype, 36)
        grads = jax.grad(lambda w, x: _penalty(jaxdet.matmul, w, x).astype(jnp.float32), argnums=(0, 1))(w, x)
        assert [g.dtype for g in grads] == [dtype, dtype]
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda w, x: _penalty(jaxdet.matmul, w, x).astype(jnp.float32)))(w, x))
        assert "dot_general" not in jaxpr and "jaxdet_gemm" in jaxpr and "jaxdet_weight_grad" in jaxpr


def test_forward_mode_and_second_order():
    # Forward mode (jvp, and jvp of grad: Hessian-vector products) and reverse over reverse work;
    # tests/test_forward_mode.py checks them against float64.
    a, b = rand((4, 8), jnp.float32, 37), rand((8, 3), jnp.float32, 38)
    for fn, primal in ((lambda a: jaxdet.matmul(a, b), a), (lambda w: jaxdet.matmul(a, w), b)):
        assert jax.jvp(fn, (primal,), (primal,))[1].shape == (4, 3)
    assert jax.grad(lambda a: jax.grad(lambda a: jnp.sum(jaxdet.matmul(a, b) ** 2))(a).sum())(a).shape == a.shape
