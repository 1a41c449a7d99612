"""jaxdet.softmax / log_softmax / softmax_cross_entropy(_with_integer_labels) / label_log_probs:
the contracts of docs/softmax.md.

  * exp, log, rsqrt (cuda/common/det_math.h): bitwise equal to the NumPy re-implementation over a
    stride through all float32 bit patterns (exp_nonpositive: equal to exp on x <= 0 and NaN), and
    their error in ulps against float64;
  * row invariance, forward and backward (a row alone vs inside batches of 4-64, bitwise);
  * the canonical order (segments, lanes, trees): outputs and gradients bitwise equal to the NumPy
    re-implementation, including rows of several segments -- the host side of CPU == GPU;
  * label_log_probs == -cross-entropy == log_softmax at the label, bitwise;
  * accuracy against float64, check_grads in float32; special values; out-of-range labels;
  * vmap, jit, axis, run-to-run; bad input. GPU tests (pytest -m gpu) compare CPU and GPU bits.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise, bits
from checks import DTYPE_IDS, DTYPES, expect
from jax.test_util import check_grads

import jaxdet
from jaxdet._src.softmax import contracts
from jaxdet._src.softmax import reference as ref
from jaxdet._src.softmax.softmax import det_math

MODES = ["softmax", "log_softmax", "cross_entropy"]


# ---- the math functions --------------------------------------------------------------------------


def test_math_functions_bitwise_equal_to_numpy():
    expect(contracts.check_math_functions())


def test_exp_and_log_error_vs_float64():
    # A denser stride through every float32 bit pattern than the report's.
    x = np.arange(0, 2**32, 257, dtype=np.uint64).astype(np.uint32).view(np.float32)
    errs = contracts.ulp_errors(x)
    assert errs["exp"] <= 0.9 and errs["log"] <= 0.8, errs


def test_math_special_values():
    x = jnp.asarray(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -1.0, 1.0, 89.5, -104.5, 1e-45], np.float32))
    e, lg = np.asarray(det_math(x, "exp")), np.asarray(det_math(x, "log"))
    np.testing.assert_array_equal(e[[0, 1, 2, 3, 6, 7, 8]], [1, 1, np.inf, 0, np.float32(np.e), np.inf, 0])
    assert e[9] == 1.0 and bits(e[4]) == 0x7FC00000
    np.testing.assert_array_equal(lg[[0, 1, 2, 6]], [-np.inf, -np.inf, np.inf, 0.0])
    assert bits(lg[3]) == bits(lg[4]) == bits(lg[5]) == 0x7FC00000
    assert lg[9] == np.float32(np.log(np.float64(np.float32(1e-45))))


# ---- row invariance ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_row_invariance_forward_and_backward(mode, dtype):
    expect(contracts.check_row_invariance(mode, dtype, n=4099))


@pytest.mark.parametrize("n", [1, 9, 1024, 8192 * 2 + 3])
def test_row_invariance_other_widths(n):
    for mode in MODES:
        expect(contracts.check_row_invariance(mode, jnp.float32, n=n, batches=(4, 64)))


# ---- the canonical order ---------------------------------------------------------------------------

SHAPES = ((1, 1), (2, 3), (5, 300), (9, 1027), (4, 8192), (3, 8193), (2, 8192 * 3 + 100), (2, 8192 * 5))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_bitwise_equal_to_canonical_numpy_order(mode, dtype):
    expect(contracts.check_canonical_order(mode, dtype, shapes=SHAPES))


def test_label_log_probs_relations():
    expect(contracts.check_label_log_probs())
    expect(contracts.check_label_log_probs(n=300))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_losses_of_half_logits_equal_their_float32_widening(dtype):
    expect(contracts.check_losses_widen_exactly(dtype))
    expect(contracts.check_losses_widen_exactly(dtype, rows=3, n=4099))


def test_subnormals_are_kept_ieee():
    # Probabilities below 2^-126 are subnormal; with flush-to-zero they would become 0.
    x = jnp.asarray(np.array([[0.0, -88.0, -95.0, -100.0, -103.0, -103.9] * 50], np.float32))
    g = jnp.ones_like(x)
    y = jaxdet.softmax(x)
    assert np.count_nonzero((np.abs(np.asarray(y)) < np.finfo(np.float32).tiny) & (np.asarray(y) != 0)) > 0
    assert_bitwise(y, ref.store(ref.softmax(np.asarray(x)), np.float32))
    dx = jax.vjp(jaxdet.softmax, x)[1](g)[0]
    assert_bitwise(dx, ref.store(ref.softmax_backward(np.asarray(x), np.asarray(g), "softmax"), np.float32))


# ---- accuracy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_accuracy_vs_float64(mode, dtype):
    expect(contracts.check_accuracy(mode, dtype))


def test_check_grads_float32():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 9)), jnp.float32)
    labels = jnp.asarray([0, 4, 8])
    for f in (
        jaxdet.softmax,
        jaxdet.log_softmax,
        lambda x: jaxdet.softmax_cross_entropy_with_integer_labels(x, labels),
        lambda x: jaxdet.label_log_probs(x, labels),
    ):
        check_grads(f, (x,), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


def test_agrees_with_jax_nn_and_optax():
    optax = pytest.importorskip("optax")
    x, labels, _, _ = contracts.make_inputs(16, 777, jnp.float32)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-7)
    close(jaxdet.softmax(x), jax.nn.softmax(x))
    close(jaxdet.log_softmax(x), jax.nn.log_softmax(x))
    close(
        jaxdet.softmax_cross_entropy_with_integer_labels(x, labels),
        optax.softmax_cross_entropy_with_integer_labels(x, labels),
    )


# ---- special values and labels -----------------------------------------------------------------


def test_masked_logits_and_non_finite_rows():
    ninf, nan = -np.inf, np.nan
    x = jnp.asarray(
        np.array(
            [
                [0.0, ninf, 1.0, ninf],  # masked entries: probability exactly 0
                [ninf, ninf, ninf, ninf],  # all masked: NaN (as jax.nn.softmax)
                [0.0, np.inf, 1.0, 2.0],  # +inf: NaN
                [0.0, nan, 1.0, 2.0],
            ],
            np.float32,
        )
    )  # NaN: NaN
    y, lp = np.asarray(jaxdet.softmax(x)), np.asarray(jaxdet.log_softmax(x))
    assert y[0, 1] == 0 and y[0, 3] == 0 and lp[0, 1] == -np.inf
    np.testing.assert_allclose(y[0, [0, 2]], np.asarray(jax.nn.softmax(x[0]))[[0, 2]], rtol=1e-6)
    for row in (1, 2, 3):
        assert np.all(bits(y[row]) == 0x7FC00000) and np.all(bits(lp[row]) == 0x7FC00000)
    for a, e in ((y, ref.softmax(np.asarray(x))), (lp, ref.log_softmax(np.asarray(x)))):
        assert_bitwise(a, ref.store(e, np.float32))


def test_out_of_range_labels_give_nan_not_a_clamped_loss():
    x, _, _, _ = contracts.make_inputs(5, 10, jnp.float32)
    labels = jnp.asarray([0, -1, 10, 2**31 - 1, 9], jnp.int32)
    loss = np.asarray(jaxdet.softmax_cross_entropy_with_integer_labels(x, labels))
    assert np.isfinite(loss[[0, 4]]).all()
    assert np.all(bits(loss[1:4]) == 0x7FC00000)
    assert np.all(bits(np.asarray(jaxdet.label_log_probs(x, labels))[1:4]) == 0x7FC00000)
    # Wide label dtypes cannot wrap an out-of-range value into range.
    big = np.asarray([0, 2**32 + 1, -(2**32) + 3, 10, 9], np.int64)
    with jax.enable_x64(True):
        loss64 = np.asarray(jaxdet.softmax_cross_entropy(x, jnp.asarray(big)))
    assert np.all(bits(loss64[1:4]) == 0x7FC00000) and bits(loss64[0]) == bits(loss[0])
    # The gradient: NaN rows where the loss is used, zero rows where its cotangent is 0 (masked).
    g = jnp.asarray([1.0, 1.0, 0.0, 0.0, 1.0])
    dx = np.asarray(jax.vjp(lambda x: jaxdet.softmax_cross_entropy(x, labels), x)[1](g)[0])
    assert np.isnan(dx[1]).all() and np.all(bits(dx[2:4]) == 0) and np.isfinite(dx[[0, 4]]).all()
    masked = jax.grad(lambda x: jnp.sum(jnp.where(labels >= 0, jaxdet.softmax_cross_entropy(x, labels), 0.0)))
    assert np.isnan(np.asarray(masked(x))[2]).all()  # label 10 is not masked by labels >= 0
    ok = labels.at[2].set(-5).at[3].set(-5)
    assert np.isfinite(
        np.asarray(jax.grad(lambda x: jnp.sum(jnp.where(ok >= 0, jaxdet.softmax_cross_entropy(x, ok), 0.0)))(x))
    ).all()


def test_cross_entropy_gradient_is_softmax_minus_one_hot():
    x, labels, _, _ = contracts.make_inputs(8, 1000, jnp.float32)
    dx = jax.grad(lambda x: jnp.sum(jaxdet.softmax_cross_entropy(x, labels)))(x)
    want = jaxdet.softmax(x) - jax.nn.one_hot(labels, 1000)
    assert_bitwise(dx, want)  # g = 1: 1 * (p - onehot) is p - onehot exactly


# ---- transformations and shapes ------------------------------------------------------------------


@pytest.mark.parametrize("n", [300, 8200], ids=["one-segment", "two-segments"])
@pytest.mark.parametrize("mode", MODES)
def test_vmap_equals_loop(mode, n):
    x, labels, g, gl = contracts.make_inputs(4 * 5, n, jnp.bfloat16)
    x, labels, g, gl = x.reshape(4, 5, n), labels.reshape(4, 5), g.reshape(4, 5, n), gl.reshape(4, 5)
    f = lambda x, lab, g, gl: contracts.value_and_grad(mode, x, lab, g, gl)
    loops = [f(x[i], labels[i], g[i], gl[i]) for i in range(4)]
    vm = jax.vmap(f)(x, labels, g, gl)
    for j in range(2):
        assert_bitwise(vm[j], jnp.stack([lp[j] for lp in loops]))
    if mode == "cross_entropy":  # labels batched, logits shared
        shared = jax.vmap(lambda lab: jaxdet.label_log_probs(x[0], lab))(labels)
        assert_bitwise(shared, jnp.stack([jaxdet.label_log_probs(x[0], labels[i]) for i in range(4)]))


@pytest.mark.parametrize("n", [300, 8200], ids=["one-segment", "two-segments"])
def test_remat_and_scan_give_the_plain_bits(n):
    """Under jax.checkpoint and inside lax.scan (micro-batches), values and gradients keep their bits."""
    rng = np.random.default_rng(7)
    logits = jnp.asarray(rng.standard_normal((4, 6, n)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, n, (4, 6)), jnp.int32)

    def loss(x, y):
        return jnp.sum(jaxdet.softmax_cross_entropy_with_integer_labels(x, y)) + jnp.sum(
            jaxdet.log_softmax(x)[..., 0] * jaxdet.softmax(x)[..., 1]
        )

    plain = jax.jit(jax.value_and_grad(loss))
    remat = jax.jit(jax.value_and_grad(jax.checkpoint(loss)))
    for (v0, g0), (v1, g1) in zip(
        [plain(logits[i], labels[i]) for i in range(4)], [remat(logits[i], labels[i]) for i in range(4)]
    ):
        assert_bitwise(v0, v1)
        assert_bitwise(g0, g1)

    def body(carry, xy):
        v, g = jax.value_and_grad(loss)(*xy)
        return carry, (v, g)

    _, (vs, gs) = jax.jit(lambda x, y: jax.lax.scan(body, 0, (x, y)))(logits, labels)
    for i in range(4):
        v, g = plain(logits[i], labels[i])
        assert_bitwise(vs[i], v)
        assert_bitwise(gs[i], g)


def test_axis_and_leading_dims():
    x, labels, _, _ = contracts.make_inputs(24, 50, jnp.float32)
    x3 = x.reshape(2, 12, 50)
    assert_bitwise(jaxdet.log_softmax(x3), jaxdet.log_softmax(x).reshape(2, 12, 50))
    assert_bitwise(jaxdet.softmax(x3.swapaxes(1, 2), axis=1), jaxdet.softmax(x3).swapaxes(1, 2))
    assert_bitwise(
        jaxdet.softmax_cross_entropy(x3.swapaxes(1, 2), labels.reshape(2, 12), axis=1),
        jaxdet.softmax_cross_entropy(x, labels).reshape(2, 12),
    )


def test_eager_jit_and_run_to_run():
    x, labels, _, _ = contracts.make_inputs(16, 3000, jnp.bfloat16)
    assert_bitwise(jaxdet.label_log_probs(x, labels), jax.jit(jaxdet.label_log_probs)(x, labels))
    expect(contracts.check_run_to_run("log_softmax", jnp.float32, rows=16, n=20000))


def test_output_dtypes_and_empty_inputs():
    x = jnp.ones((3, 5), jnp.bfloat16)
    assert jaxdet.softmax(x).dtype == jnp.bfloat16 and jaxdet.log_softmax(x).dtype == jnp.bfloat16
    assert jaxdet.softmax_cross_entropy(x, jnp.zeros((3,), jnp.int32)).dtype == jnp.float32
    assert jaxdet.softmax(jnp.zeros((0, 5))).shape == (0, 5)
    assert jaxdet.softmax_cross_entropy(jnp.zeros((0, 5)), jnp.zeros((0,), jnp.int32)).shape == (0,)


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    x = jnp.ones((4, 8))
    labels = jnp.zeros((4,), jnp.int32)
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        jaxdet.softmax(x.astype(jnp.int32))
    with pytest.raises(TypeError, match="logits must be float32"):
        jaxdet.softmax_cross_entropy(x.astype(jnp.int8), labels)
    with pytest.raises(TypeError, match="labels must be integer class indices"):
        jaxdet.softmax_cross_entropy(x, jax.nn.one_hot(labels, 8))
    with pytest.raises(TypeError, match="labels must be integer class indices"):
        jaxdet.softmax_cross_entropy(x, labels.astype(bool))
    with pytest.raises(ValueError, match=r"labels must have the logits' shape without the class axis, \(4,\)"):
        jaxdet.softmax_cross_entropy(x, jnp.zeros((4, 1), jnp.int32))
    with pytest.raises(ValueError, match="at least one class"):
        jaxdet.softmax_cross_entropy(jnp.ones((4, 0)), labels)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        jaxdet.softmax(x, axis=2)
    with pytest.raises(TypeError, match="axis must be an int"):
        jaxdet.log_softmax(x, axis=None)
    with pytest.raises(ValueError, match="op must be one of"):
        det_math(x, "sin")


# ---- GPU (pytest -m gpu): CPU == GPU bitwise ------------------------------------------------------

# Up to 8192: one segment; 8193 ... 131072: 2-16 segments (one cluster per row on Hopper); 140001:
# 18 segments (the pass kernels everywhere).
GPU_SHAPES = (
    (1, 1),
    (3, 5),
    (5, 300),
    (64, 1024),
    (9, 1027),
    (130, 4096),
    (9, 8192),
    (4, 8193),
    (70, 40961),
    (3, 128256),
    (2, 131072),
    (2, 140001),
)
# Rows of 2-16 segments, including more rows than clusters run at once (each walks several rows).
CLUSTER_SHAPES = ((4, 8193), (2100, 8200), (5, 57345), (3, 128256), (2, 131072))


@pytest.mark.gpu
def test_gpu_math_functions_equal_cpu(on_gpu):
    expect(contracts.check_math_functions())
    expect(contracts.check_cpu_equals_device_math())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_gpu_losses_of_half_logits_equal_their_float32_widening(dtype, on_gpu):
    expect(contracts.check_losses_widen_exactly(dtype))
    expect(contracts.check_losses_widen_exactly(dtype, rows=5, n=128256))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_gpu_equals_cpu_bitwise(mode, dtype, on_gpu):
    expect(contracts.check_cpu_equals_device(mode, dtype, shapes=GPU_SHAPES))


_PASSES_SCRIPT = """
import hashlib, sys, jax, numpy as np
from jaxdet._src.softmax import contracts
from jaxdet._src.core.switches import active_testing_overrides
assert active_testing_overrides() == {"softmax": "passes"}, active_testing_overrides()
with jax.default_device(jax.devices("gpu")[0]):
    for mode, dtype, rows, n in eval(sys.argv[1]):
        out, dx = contracts.value_and_grad(mode, *contracts.make_inputs(rows, n, getattr(jax.numpy, dtype)))
        print(hashlib.sha1(np.asarray(out).tobytes() + np.asarray(dx).tobytes()).hexdigest())
"""


@pytest.mark.gpu
def test_gpu_cluster_and_pass_kernels_agree(on_gpu):
    """Rows of 2-16 segments run one cluster per row on Hopper, the pass kernels elsewhere (and with
    JAXDET_TESTING=softmax=passes): the same bits, outputs and gradients."""
    import hashlib
    import os
    import subprocess
    import sys
    import tempfile

    cases = [(m, d, r, n) for m in MODES for d in ("bfloat16", "float32") for r, n in CLUSTER_SHAPES]
    here = []
    for mode, dtype, rows, n in cases:
        out, dx = contracts.value_and_grad(mode, *contracts.make_inputs(rows, n, getattr(jnp, dtype)))
        here.append(hashlib.sha1(np.asarray(out).tobytes() + np.asarray(dx).tobytes()).hexdigest())
    env = dict(os.environ, JAXDET_TESTING="softmax=passes")
    r = subprocess.run(
        [sys.executable, "-c", _PASSES_SCRIPT, repr(cases)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tempfile.gettempdir(),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    differ = [c for c, a, b in zip(cases, here, r.stdout.split()) if a != b]
    assert len(r.stdout.split()) == len(cases) and not differ, differ


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_gpu_matches_numpy_order_and_row_invariance(mode, on_gpu):
    expect(contracts.check_canonical_order(mode, jnp.float32, shapes=GPU_SHAPES[:9]))
    for n in (4099, 128256):
        expect(contracts.check_row_invariance(mode, jnp.bfloat16, n=n))
    expect(contracts.check_run_to_run(mode, jnp.bfloat16, rows=512, n=128256))


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "softmax_cross_entropy", "label_log_probs"])
def test_forward_mode_and_second_derivatives_run(name):
    """Forward mode and second derivatives work (accuracy and row invariance: tests/test_forward_mode.py)."""
    x = jnp.linspace(-2.0, 2.0, 4 * 32, dtype=jnp.float32).reshape(4, 32)
    labels = jnp.arange(4, dtype=jnp.int32)
    fn = getattr(jaxdet, name)
    f = (lambda x: fn(x, labels)) if "softmax_" in name or "label" in name else fn
    assert jax.jvp(f, (x,), (x,))[1].shape == f(x).shape
    assert jax.grad(lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)))(x).shape == x.shape
