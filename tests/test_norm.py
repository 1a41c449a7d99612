"""jaxdet.rms_norm / jaxdet.layer_norm: the contracts of docs/norm.md.

* row invariance, forward and backward (a row alone vs inside batches of 4-64, bitwise);
* the canonical order: y, dx, dscale, dbias bitwise equal to the NumPy re-implementation
  (jaxdet/_src/norm/reference.py) -- the host side of CPU == GPU; the GPU tests compare the bits;
* parameter gradients: the canonical tree over tokens (aligned power-of-two blocks are subtrees);
* accuracy against float64 (forward and backward) and check_grads in float32;
* float32 statistics for bfloat16/float16 inputs; IEEE subnormals;
* vmap, jit, run-to-run; bad input.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from checks import DTYPE_IDS, DTYPES, expect
from jax.test_util import check_grads

import jaxdet
from jaxdet._src.norm import contracts
from jaxdet._src.norm import reference as ref

KINDS = ["rms", "layer"]


# ---- row invariance ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_row_invariance_forward_and_backward(kind, dtype):
    expect(contracts.check_row_invariance(kind, dtype, n=4096))


@pytest.mark.parametrize("n", [1, 7, 1000, 9000])
def test_row_invariance_other_widths(n):
    for kind in KINDS:
        expect(contracts.check_row_invariance(kind, jnp.float32, n=n, batches=(4, 64)))


def test_leading_dims_are_tokens():
    x, w, b, _ = contracts.make_inputs(24, 300, jnp.bfloat16)
    flat = jaxdet.layer_norm(x, w, b)
    assert_bitwise(jaxdet.layer_norm(x.reshape(2, 3, 4, 300), w, b), flat.reshape(2, 3, 4, 300))


# ---- the canonical order (CPU kernels vs the NumPy re-implementation) ------------------------------

SHAPES = ((1, 1), (1, 4), (3, 5), (5, 300), (33, 1024), (70, 1027), (64, 4096), (9, 8193), (2, 20000), (2100, 16))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_bitwise_equal_to_canonical_numpy_order(kind, dtype):
    expect(contracts.check_canonical_order(kind, dtype, shapes=SHAPES))


@pytest.mark.parametrize("kind", KINDS)
def test_subnormals_are_kept_ieee(kind):
    # Tiny inputs: the squares are subnormal (row 0), or the inputs themselves are (row 1). XLA's CPU
    # runtime would flush them to zero; the kernels (like the GPU) keep IEEE subnormals. eps is the
    # smallest normal float, so the subnormal mean square still shows in rstd.
    x = np.full((3, 64), 3e-20, np.float32) * np.linspace(1, 2, 64, dtype=np.float32)
    x[1] = np.float32(1e-39) * np.arange(64, dtype=np.float32)
    x = jnp.asarray(x)
    w = jnp.ones((64,), jnp.float32)
    b = jnp.zeros((64,), jnp.float32)
    g = jnp.ones((3, 64), jnp.float32)
    eps = float(np.finfo(np.float32).tiny)
    assert np.any(np.asarray(contracts.value_and_grads(kind, x, w, b, g, eps=eps)[0])[1] != 0)
    got = contracts.value_and_grads(kind, x, w, b, g, eps=eps)
    want = contracts.reference(kind, x, w, b, g, eps=eps)
    for a, e in zip(got, want):
        assert_bitwise(a, e, f"{kind} with subnormals")


# ---- parameter gradients: the tree over tokens ---------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_param_grads_are_the_tree_over_tokens(kind):
    # Aligned power-of-two blocks of tokens (smaller and larger than the kernels' 32-token
    # partials) are subtrees: a device holding each block reproduces the full-batch gradient.
    expect(contracts.check_param_grad_tree(kind, tokens=256, n=40))


def test_param_grads_of_odd_token_counts_match_the_padded_tree():
    # 70 tokens: the tree pads with absent leaves (tree_sum's tree), checked against the reference.
    expect(contracts.check_canonical_order("layer", jnp.float32, shapes=((70, 33), (1, 33), (33, 33), (65, 2))))


def test_param_grad_dtype_is_the_scale_dtype_rounded_once():
    x, w, b, g = contracts.make_inputs(40, 64, jnp.bfloat16)
    w16 = w.astype(jnp.bfloat16)
    _, vjp16 = jax.vjp(lambda w: jaxdet.rms_norm(x, w), w16)
    _, vjp32 = jax.vjp(lambda w: jaxdet.rms_norm(x, w), w)
    (dw16,), (dw32,) = vjp16(g), vjp32(g)
    assert dw16.dtype == jnp.bfloat16
    # bf16 scale widened exactly: the float32 gradient of the same values, rounded once.
    _, vjp32b = jax.vjp(lambda w: jaxdet.rms_norm(x, w), w16.astype(jnp.float32))
    assert_bitwise(dw16, vjp32b(g)[0].astype(jnp.bfloat16))
    assert dw32.dtype == jnp.float32


# ---- accuracy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_accuracy_vs_float64(kind, dtype):
    expect(contracts.check_accuracy(kind, dtype))


@pytest.mark.parametrize("kind", KINDS)
def test_check_grads_float32(kind):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(7), jnp.float32)
    b = jnp.asarray(0.3 * rng.standard_normal(7), jnp.float32)
    f = (
        (lambda x, w, b: jaxdet.rms_norm(x, w, 1e-3))
        if kind == "rms"
        else (lambda x, w, b: jaxdet.layer_norm(x, w, b, 1e-3))
    )
    check_grads(f, (x, w, b), order=1, modes=["rev"], atol=5e-2, rtol=5e-2, eps=1e-2)


def test_half_inputs_have_float32_statistics():
    # float16 x = 300: x^2 = 90000 overflows float16 (max 65504); float32 statistics do not.
    x = jnp.full((2, 256), 300.0, jnp.float16).at[:, ::2].set(-300.0)
    y = jaxdet.rms_norm(x, jnp.ones((256,), jnp.float16))
    assert y.dtype == jnp.float16
    np.testing.assert_array_equal(np.abs(np.asarray(y, np.float32)), 1.0)
    # bfloat16: a row whose mean is large relative to its spread (catastrophic in low precision).
    xb = (1000.0 + jnp.arange(512, dtype=jnp.float32) % 4).astype(jnp.bfloat16)[None]
    yb = jaxdet.layer_norm(xb, None, None)
    xf = np.asarray(xb, np.float64)
    want = (xf - xf.mean()) / np.sqrt(xf.var() + 1e-6)
    assert np.linalg.norm(np.asarray(yb, np.float64) - want) / np.linalg.norm(want) < 8e-3


def test_none_scale_and_bias():
    x, w, b, _ = contracts.make_inputs(6, 50, jnp.float32)
    assert_bitwise(jaxdet.rms_norm(x, None), jaxdet.rms_norm(x, jnp.ones((50,))))
    # No output here is -0, so adding a zero bias changes no bit.
    assert_bitwise(jaxdet.layer_norm(x, w, None), jaxdet.layer_norm(x, w, jnp.zeros((50,))))


# ---- transformations ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_equals_loop(kind):
    x, w, b, g = contracts.make_inputs(4 * 6, 96, jnp.bfloat16)
    x, g = x.reshape(4, 6, 96), g.reshape(4, 6, 96)
    f = lambda x, w, b: contracts.apply(kind, x, w, b)
    loop = jnp.stack([f(x[i], w, b) for i in range(4)])
    assert_bitwise(jax.vmap(f, in_axes=(0, None, None))(x, w, b), loop)
    assert_bitwise(
        jax.jit(jax.vmap(f, in_axes=(1, None, None), out_axes=1))(x.swapaxes(0, 1), w, b).swapaxes(0, 1), loop
    )
    ws = jnp.stack([w * (1 + i) for i in range(4)])
    loop_w = jnp.stack([f(x[i], ws[i], b) for i in range(4)])
    assert_bitwise(jax.vmap(f, in_axes=(0, 0, None))(x, ws, b), loop_w)
    assert_bitwise(jax.vmap(f, in_axes=(None, 0, None))(x[0], ws, b), jnp.stack([f(x[0], ws[i], b) for i in range(4)]))
    # Per-example gradients (vmap of the backward) equal the per-example loop.
    grad = jax.grad(
        lambda x, w, b, g: jnp.sum(f(x, w, b).astype(jnp.float32) * g.astype(jnp.float32)), argnums=(0, 1, 2)
    )
    gv = jax.vmap(grad, in_axes=(0, None, None, 0))(x, w, b, g)
    for i in range(4):
        for a, e in zip(gv, grad(x[i], w, b, g[i])):
            assert_bitwise(a[i], e)


def test_eager_jit_and_run_to_run():
    x, w, b, g = contracts.make_inputs(64, 1000, jnp.bfloat16)
    assert_bitwise(jaxdet.layer_norm(x, w, b), jax.jit(jaxdet.layer_norm)(x, w, b))
    expect(contracts.check_run_to_run("layer", jnp.float32, tokens=64, n=1000))


def test_under_remat_and_scan():
    x, w, b, _ = contracts.make_inputs(8, 64, jnp.float32)
    f = lambda w: jnp.sum(jnp.sin(jaxdet.layer_norm(x, w, b)))
    assert_bitwise(jax.grad(jax.checkpoint(f))(w), jax.grad(f)(w))

    def body(c, xi):
        return c + jnp.sum(jaxdet.rms_norm(xi, w)), jaxdet.rms_norm(xi, w)

    _, ys = jax.lax.scan(body, 0.0, x.reshape(4, 2, 64))
    assert_bitwise(ys.reshape(8, 64), jaxdet.rms_norm(x, w))


def test_empty_inputs():
    assert jaxdet.rms_norm(jnp.zeros((0, 8)), jnp.ones((8,))).shape == (0, 8)
    assert jaxdet.layer_norm(jnp.zeros((3, 0)), jnp.ones((0,)), jnp.zeros((0,))).shape == (3, 0)


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    x = jnp.ones((4, 8))
    w = jnp.ones((8,))
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        jaxdet.rms_norm(x.astype(jnp.int32), w)
    with pytest.raises(TypeError, match="x must be a JAX or NumPy array"):
        jaxdet.rms_norm([[1.0]], w)
    with pytest.raises(ValueError, match=r"scale must have shape \(8,\)"):
        jaxdet.rms_norm(x, jnp.ones((7,)))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        jaxdet.layer_norm(x, w, jnp.ones((4, 8)))
    with pytest.raises(TypeError, match="scale must be float32"):
        jaxdet.rms_norm(x, jnp.ones((8,), jnp.int32))
    with pytest.raises(ValueError, match="eps must be a finite float >= 0"):
        jaxdet.rms_norm(x, w, -1.0)
    with pytest.raises(ValueError, match="eps must be a finite float >= 0"):
        jaxdet.rms_norm(x, w, float("nan"))
    with pytest.raises(TypeError, match="eps must be a static Python float"):
        jax.jit(lambda e: jaxdet.rms_norm(x, w, e))(1e-5)
    with pytest.raises(ValueError, match="at least one dimension"):
        jaxdet.rms_norm(jnp.float32(1.0), jnp.ones(()))


# ---- GPU (pytest -m gpu): CPU == GPU bitwise ------------------------------------------------------

GPU_SHAPES = (
    (1, 1),
    (3, 5),
    (5, 300),
    (64, 1024),
    (70, 1027),
    (40, 1026),
    (33, 2048),
    (130, 4096),
    (9, 8192),
    (4, 8193),
    (3, 20000),
    (2100, 64),
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_equals_cpu_bitwise(kind, dtype, on_gpu):
    expect(contracts.check_cpu_equals_device(kind, dtype, shapes=GPU_SHAPES))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_matches_numpy_order_and_row_invariance(kind, on_gpu):
    expect(contracts.check_canonical_order(kind, jnp.float32, shapes=GPU_SHAPES))
    for n in (4096, 20000):
        expect(contracts.check_row_invariance(kind, jnp.bfloat16, n=n))
    expect(contracts.check_param_grad_tree(kind, tokens=1024, n=300))
    expect(contracts.check_run_to_run(kind, jnp.bfloat16, tokens=4096, n=4096))


@pytest.mark.gpu
def test_gpu_unaligned_rows(gpu):
    # Rows whose start is not 16-byte aligned take the scalar path: the same bits.
    with jax.default_device(gpu):
        x, w, b, g = contracts.make_inputs(9, 1027, jnp.bfloat16)
        got = contracts.value_and_grads("layer", x[:, 1:], w[1:], b[1:], g[:, 1:])
    want = contracts.reference("layer", x[:, 1:], w[1:], b[1:], g[:, 1:])
    for a, e in zip(got, want):
        assert_bitwise(a, e)
    assert ref.F32 is np.float32


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_forward_mode_and_second_derivatives_run(name):
    """Forward mode and second derivatives work (accuracy and row invariance: tests/test_forward_mode.py)."""
    x = jnp.linspace(-1.0, 1.0, 4 * 64, dtype=jnp.float32).reshape(4, 64)
    w = jnp.full((64,), 1.5, jnp.float32)
    f = (lambda x: jaxdet.rms_norm(x, w)) if name == "rms_norm" else (lambda x: jaxdet.layer_norm(x, w, w))
    assert jax.jvp(f, (x,), (x,))[1].shape == x.shape
    assert jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)))(x).shape == x.shape
