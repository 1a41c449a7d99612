"""The GEMM chunk rule (docs/matmul.md, "The reduction: chunks of K and the canonical tree"): every
product folds K within chunks of GEMM_CHUNK elements and combines the chunk partials by the
canonical tree. The primitive is bound with small chunks here so that the tree runs at tiny sizes;
the public paths run with K > GEMM_CHUNK at tiny M and N."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from checks import DTYPE_IDS, DTYPES

import jaxdet
from jaxdet._src.matmul import contracts, raw
from jaxdet._src.matmul.matmul import GEMM_CHUNK, gemm_cpu_workspace_bytes, gemm_workspace_bytes

rand = contracts.rand
_gemm = contracts._gemm
C = GEMM_CHUNK
K_PUBLIC = 2 * C + 300  # three chunks through the public paths, the last one short

# Relative Frobenius error against float64 (docs/matmul.md, "Dtypes and accuracy").
ACCURACY = {jnp.float32: 2e-6, jnp.bfloat16: 5e-3, jnp.float16: 1e-3}


def test_chunk_constant():
    assert jaxdet.GEMM_CHUNK == jaxdet.matmul.GEMM_CHUNK == GEMM_CHUNK == 8192
    assert jaxdet.WGRAD_CHUNK_TOKENS == GEMM_CHUNK


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemm_is_the_tree_of_its_chunks(dtype):
    contracts.check_gemm_chunk_rule(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_appended_zeros_change_no_bit(dtype):
    contracts.check_gemm_appended_zeros(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matmul_beyond_one_chunk_is_the_tree(dtype):
    contracts.check_matmul_chunk_rule(dtype)


def test_raw_target_takes_the_chunk():
    a = rand((1, 5, 200), jnp.float32, 1)
    b = rand((1, 200, 24), jnp.float32, 2)
    assert_bitwise(raw.gemm(a, b, chunk=64), _gemm(a, b, 64, jnp.float32))
    assert_bitwise(raw.gemm(a, b), _gemm(a, b, GEMM_CHUNK, jnp.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rows_invariant_beyond_one_chunk(dtype):
    """Forward (the primitive with chunks of 64; jaxdet.matmul with K > GEMM_CHUNK) and dA (the
    gradient of jaxdet.matmul, which contracts N > GEMM_CHUNK): a row alone, inside M = 200 and
    permuted, has the same bits."""
    m = 200
    perm = np.random.default_rng(3).permutation(m)
    a = rand((1, m, 232), dtype, 4)
    b = rand((1, 232, 24), dtype, 5)
    full = _gemm(a, b, 64, dtype)
    for i in (0, 77, m - 1):
        assert_bitwise(_gemm(a[:, i : i + 1], b, 64, dtype), full[:, i : i + 1])
    assert_bitwise(_gemm(a[:, perm], b, 64, dtype), full[:, perm])

    contracts.check_row_invariance_forward(dtype, k=K_PUBLIC, n=16, m=m)

    n = C + 300
    x = rand((m, 16), dtype, 6)
    w = rand((16, n), dtype, 7)
    g = rand((m, n), dtype, 8)
    full = contracts._da(x, w, g)
    for i in (0, 77, m - 1):
        assert_bitwise(contracts._da(x[i : i + 1], w, g[i : i + 1]), full[i : i + 1])
    assert_bitwise(contracts._da(x[perm], w, g[perm]), full[perm])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_transformations_equal_eager_beyond_one_chunk(dtype):
    """jit, vmap, grad and remat give eager's bits with K > GEMM_CHUNK (and the primitive's
    batching rule keeps a small chunk)."""
    a = rand((3, K_PUBLIC), dtype, 10)
    b = rand((K_PUBLIC, 16), dtype, 11)
    eager = jaxdet.matmul(a, b)
    assert_bitwise(jax.jit(jaxdet.matmul)(a, b), eager)
    a2 = jnp.stack([a, a[::-1]])
    assert_bitwise(jax.vmap(jaxdet.matmul, in_axes=(0, None))(a2, b), jnp.stack([eager, eager[::-1]]))

    def loss(x, w):
        return jnp.sum(jaxdet.matmul(x, w).astype(jnp.float32) ** 2)

    grads = jax.grad(loss, argnums=(0, 1))(a, b)
    assert_bitwise(jax.jit(jax.grad(loss, argnums=(0, 1)))(a, b), grads)
    assert_bitwise(jax.grad(jax.checkpoint(loss), argnums=(0, 1))(a, b), grads)

    # the primitive under vmap: a vmapped a folds into M, a vmapped b is a batched GEMM
    x = rand((3, 1, 5, 200), dtype, 12)
    y = rand((3, 1, 200, 24), dtype, 13)
    loop = jnp.stack([_gemm(x[i], y[0], 64, dtype) for i in range(3)])
    assert_bitwise(jax.vmap(lambda x: _gemm(x, y[0], 64, dtype))(x), loop)
    loop_b = jnp.stack([_gemm(x[i], y[i], 64, dtype) for i in range(3)])
    assert_bitwise(jax.jit(jax.vmap(lambda x, y: _gemm(x, y, 64, dtype)))(x, y), loop_b)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_accuracy_beyond_one_chunk(dtype):
    a = rand((3, K_PUBLIC), dtype, 20)
    b = rand((K_PUBLIC, 16), dtype, 21)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    for preferred, bound in ((None, ACCURACY[dtype]), (jnp.float32, 2e-6)):
        out = np.asarray(jaxdet.matmul(a, b, preferred_element_type=preferred), np.float64)
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < bound


def test_bad_chunk_is_refused():
    a = rand((1, 4, 100), jnp.float32, 30)
    b = rand((1, 100, 8), jnp.float32, 31)
    for chunk in (0, -1, 2.5, 48):
        with pytest.raises(ValueError, match="chunk must be a positive int multiple of 64"):
            _gemm(a, b, chunk, jnp.float32)
    with pytest.raises(Exception, match="chunk must be a positive multiple of 64"):
        raw.gemm(a, b, chunk=0).block_until_ready()


def test_workspace_bytes():
    assert gemm_workspace_bytes(1, 4, 8, C, C) == 0  # one chunk: no workspace
    n, L, M, N = 3, 2, 5, 300
    partials = n * L * (M + 127) * (N + 255) * 4
    flags = n * L * 1 * 19 * 4
    assert gemm_workspace_bytes(L, M, N, 2 * C + 1, C) == partials + flags + 1024
    # the CPU kernel's binary counter: bit_length(n) + 1 partials of [L, M, N]
    assert gemm_cpu_workspace_bytes(L, M, N, C, C) == 0
    assert gemm_cpu_workspace_bytes(L, M, N, 2 * C + 1, C) == 3 * L * M * N * 4
    assert gemm_cpu_workspace_bytes(L, M, N, 8 * C, C) == 5 * L * M * N * 4


# ---- GPU: the same checks on the GPU's kernels (`pytest -m gpu`) ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_gemm_is_the_tree_of_its_chunks(dtype, on_gpu):
    """The narrow tiles (M <= 16) run a CTA per chunk, on narrow outputs (n = 24, 64) and on
    outputs whose tiles alone fill the SMs (n = 2048 at M = 3 in two batches); the transposed b
    runs the dA sets' tiles, M = 200 the cooperative tiles."""
    contracts.check_gemm_chunk_rule(dtype)
    contracts.check_gemm_chunk_rule(dtype, m=3, n=2048, counts=(2, 3, 5))
    contracts.check_gemm_chunk_rule(dtype, chunk=GEMM_CHUNK, m=3, n=64, counts=(2, 3, 5))
    contracts.check_gemm_chunk_rule(dtype, chunk=GEMM_CHUNK, m=200, n=256, counts=(2,))
    contracts.check_matmul_chunk_rule(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_appended_zeros_change_no_bit(dtype, on_gpu):
    contracts.check_gemm_appended_zeros(dtype)
    contracts.check_gemm_appended_zeros(dtype, chunk=GEMM_CHUNK, m=3, n=64)
