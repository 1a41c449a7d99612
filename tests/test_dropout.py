"""jaxdet.dropout: each test proves one contract of docs/dropout.md."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxdet
from jaxdet import random as jr
from jaxdet.dropout import drop_threshold, keep_scale
from bitwise import bits
from philox_reference import keep_mask

BITS = {np.dtype(np.float32): np.uint32, np.dtype(ml_dtypes.bfloat16): np.uint16, np.dtype(np.float16): np.uint16}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
CANONICAL_NAN = {np.dtype(np.float32): 0x7FC00000, np.dtype(ml_dtypes.bfloat16): 0x7FC0, np.dtype(np.float16): 0x7E00}


def reference(x, key, rate, offset=0):
    """docs/dropout.md, written out in NumPy: the kept value is dtype(float32(x) * float32(1/(1-rate)))."""
    x = np.asarray(x)
    keep = keep_mask(np.asarray(key), x.size, rate, offset).reshape(x.shape)
    with np.errstate(over="ignore", invalid="ignore"):
        kept = (x.astype(np.float32) * keep_scale(rate)).astype(x.dtype)
    out = np.where(keep, kept, np.zeros((), x.dtype))
    canonical_nan = np.array(CANONICAL_NAN[x.dtype], BITS[x.dtype]).view(x.dtype)
    return np.where(np.isnan(out), canonical_nan, out)


def random_x(shape, dtype, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_mask_is_the_documented_function_of_key_and_index(dtype, rate):
    x = random_x((7, 131), dtype)
    key = jr.key(2024)
    for offset in (0, 3, 2**33 + 1):  # 2**33: counters with a non-zero high word (64-bit index)
        out = jaxdet.dropout(x, key, rate, offset=offset)
        np.testing.assert_array_equal(bits(out), bits(reference(x, key, rate, offset)))


def test_keep_threshold_and_scale():
    assert drop_threshold(0.5) == 2**31
    assert drop_threshold(0.1) == round(0.1 * 2**32)
    assert drop_threshold(1 - 2.0**-40) == 2**32 - 1
    assert keep_scale(0.1) == np.float32(1 / 0.9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_slice_with_offset_equals_slice_of_whole(dtype):
    x = random_x((16, 257), dtype, seed=1)
    key = jr.key(7)
    whole = bits(jaxdet.dropout(x, key, 0.3)).ravel()
    flat = x.ravel()
    for a, b in [(0, 1), (1, 2), (3, 11), (5, 4000), (17, 4112), (4096, 4112), (4111, 4112)]:
        part = jaxdet.dropout(flat[a:b], key, 0.3, offset=a)
        np.testing.assert_array_equal(bits(part), whole[a:b], err_msg=f"slice {a}:{b}")


def test_mask_does_not_depend_on_dtype():
    x32 = random_x((33, 65), jnp.float32, seed=2)
    key = jr.key(99)
    masks = [np.asarray(jaxdet.dropout(x32.astype(dt), key, 0.25)) != 0 for dt in DTYPES]
    np.testing.assert_array_equal(masks[0], masks[1])
    np.testing.assert_array_equal(masks[0], masks[2])


def test_jit_equals_eager_and_repeats():
    x = random_x((5, 999), jnp.bfloat16, seed=3)
    key = jr.key(5)
    eager = bits(jaxdet.dropout(x, key, 0.2, offset=6))
    jitted = jax.jit(lambda x, k: jaxdet.dropout(x, k, 0.2, offset=6))
    np.testing.assert_array_equal(bits(jitted(x, key)), eager)
    np.testing.assert_array_equal(bits(jitted(x, key)), eager)


@pytest.mark.parametrize("dtype", DTYPES)
def test_identity_when_nothing_is_dropped(dtype):
    x = random_x((4, 9), dtype).at[0, 0].set(jnp.nan)
    for out in (jaxdet.dropout(x, jr.key(0), 0.0), jaxdet.dropout(x, jr.key(0), 0.7, deterministic=True),
                jaxdet.dropout(x, None, 0.5, deterministic=True), jaxdet.dropout(x, None, 0.0)):
        np.testing.assert_array_equal(bits(out), bits(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_in_dropped_slot_gives_zero_and_kept_nan_is_canonical(dtype):
    payloads = np.array([0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFFFFFFF], np.uint32).view(np.float32)
    x = jnp.asarray(np.resize(payloads, 4096)).astype(dtype)
    out = bits(jaxdet.dropout(x, jr.key(1), 0.5))
    keep = keep_mask(np.asarray(jr.key(1)), 4096, 0.5)
    assert np.all(out[~keep] == 0)  # +0.0 exactly
    assert np.all(out[keep] == CANONICAL_NAN[np.dtype(dtype)])  # the canonical quiet NaN, never a payload


def test_subnormals_and_rounding_match_ieee_reference():
    # Subnormals (XLA's CPU runtime flushes them; the kernels must not), the float16 overflow edge,
    # and a float32 overflow to inf.
    tiny = np.array([1e-45, 3e-42, -2e-39, 1e-38, 65504.0, -65519.0, 3.4e38], np.float32)
    x = np.tile(tiny, 64)
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        with np.errstate(over="ignore"):
            xd = x.astype(dtype)
        out = jaxdet.dropout(jnp.asarray(xd), jr.key(3), 0.05)
        np.testing.assert_array_equal(bits(out), bits(reference(xd, jr.key(3), 0.05)))


def test_empty_and_scalar_inputs():
    key = jr.key(0)
    assert jaxdet.dropout(jnp.zeros((0, 3), jnp.float32), key, 0.5).shape == (0, 3)
    s = jnp.float32(2.0)
    out = jaxdet.dropout(s, key, 0.5)
    np.testing.assert_array_equal(bits(out), bits(reference(np.float32(2.0).reshape(()), key, 0.5)))


def test_bad_arguments_raise_before_any_kernel():
    x = jnp.ones((8,), jnp.float32)
    key = jr.key(0)
    for rate in (-0.1, 1.0, 1.5, float("nan")):
        with pytest.raises(ValueError, match="rate"):
            jaxdet.dropout(x, key, rate)
    with pytest.raises(TypeError, match="rate"):
        jaxdet.dropout(x, key, "0.5")
    with pytest.raises(TypeError, match="rate"):
        jax.jit(lambda r: jaxdet.dropout(x, key, r))(0.5)
    for bad in (jnp.ones((8,), jnp.int32), np.ones((8,), np.float64), jnp.ones((8,), jnp.bool_)):
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            jaxdet.dropout(bad, key, 0.5)
    with pytest.raises(TypeError, match="x must be"):
        jaxdet.dropout([1.0, 2.0], key, 0.5)
    with pytest.raises(ValueError, match="offset"):
        jaxdet.dropout(x, key, 0.5, offset=-1)
    with pytest.raises(TypeError, match="offset"):
        jaxdet.dropout(x, key, 0.5, offset=1.5)
    with pytest.raises(ValueError, match="broadcast_dims"):
        jaxdet.dropout(x, key, 0.5, broadcast_dims=(1,))
    with pytest.raises(ValueError, match="repeated"):
        jaxdet.dropout(jnp.ones((2, 2)), key, 0.5, broadcast_dims=(0, -2))
    with pytest.raises(TypeError, match="Philox key"):
        jaxdet.dropout(x, None, 0.5)


def test_broadcast_dims_share_one_mask_indexed_in_the_reduced_shape():
    x = random_x((6, 5, 40), jnp.float32, seed=4)
    key = jr.key(11)
    out = np.asarray(jaxdet.dropout(x, key, 0.4, broadcast_dims=(1,)))
    keep = keep_mask(np.asarray(key), 6 * 40, 0.4).reshape(6, 1, 40)
    expected = np.where(keep, (np.asarray(x) * keep_scale(0.4)).astype(np.float32), np.float32(0))
    np.testing.assert_array_equal(bits(out), bits(expected))
    # A broadcast over a size-1 dimension is the same mask and the same bits as no broadcast.
    for dtype in DTYPES:
        y = random_x((1, 300), dtype, seed=5)
        np.testing.assert_array_equal(
            bits(jaxdet.dropout(y, key, 0.4, broadcast_dims=(0,))), bits(jaxdet.dropout(y, key, 0.4)))


def test_gradient_is_the_same_mask_and_keeps_no_residual_but_the_key():
    x = random_x((64, 33), jnp.float32, seed=6)
    key = jr.key(8)
    f = lambda x: jaxdet.dropout(x, key, 0.3, offset=5)
    y, f_vjp = jax.vjp(f, x)
    g = random_x((64, 33), jnp.float32, seed=7)
    (dx,) = f_vjp(g)
    np.testing.assert_array_equal(bits(dx), bits(reference(g, key, 0.3, offset=5)))
    # What the backward keeps: the 8-byte key only (no mask, no input).
    residual_sizes = [np.size(leaf) for leaf in jax.tree_util.tree_leaves(f_vjp)]
    assert max(residual_sizes, default=0) <= 2, residual_sizes
    jaxpr = jax.make_jaxpr(lambda x, g: jax.vjp(f, x)[1](g))(x, g)
    assert "jaxdet_dropout" in str(jaxpr)


def test_check_grads_and_checkpoint():
    x = random_x((8, 16), jnp.float32, seed=9)
    key = jr.key(4)
    f = lambda x: jnp.sum(jnp.sin(jaxdet.dropout(x, key, 0.25)) ** 2)
    # eps=1e-2: with float32 sums, the default 1e-4 step drowns the difference in rounding.
    check_grads(f, (x,), order=1, modes=["rev"], eps=1e-2)
    # Second order (reverse over reverse) on a quadratic, where central differences are exact.
    check_grads(lambda x: jnp.sum(jaxdet.dropout(x, key, 0.25) ** 2), (x,), order=2, modes=["rev"], eps=1e-2)
    g_plain = jax.grad(f)(x)
    g_remat = jax.grad(jax.checkpoint(f))(x)
    np.testing.assert_array_equal(bits(g_plain), bits(g_remat))
    g_jit = jax.jit(jax.grad(jax.checkpoint(f)))(x)
    np.testing.assert_array_equal(bits(g_plain), bits(g_jit))


def test_vmap_batched_key_gives_each_example_its_own_mask():
    x = random_x((4, 3, 50), jnp.bfloat16, seed=10)
    keys = jr.split(jr.key(12), 4)
    out = jax.vmap(lambda xi, ki: jaxdet.dropout(xi, ki, 0.5, offset=2))(x, keys)
    for i in range(4):
        np.testing.assert_array_equal(bits(out[i]), bits(jaxdet.dropout(x[i], keys[i], 0.5, offset=2)))
    # A batched key with an unbatched x: one mask per key.
    shared_x = x[0]
    out = jax.vmap(lambda ki: jaxdet.dropout(shared_x, ki, 0.5), in_axes=0)(keys)
    for i in range(4):
        np.testing.assert_array_equal(bits(out[i]), bits(jaxdet.dropout(shared_x, keys[i], 0.5)))


def test_vmap_unbatched_key_gives_every_example_the_same_mask():
    x = random_x((3, 7, 20), jnp.float32, seed=11)
    key = jr.key(13)
    out = jax.vmap(lambda xi: jaxdet.dropout(xi, key, 0.5), in_axes=1, out_axes=1)(x)
    for i in range(7):
        np.testing.assert_array_equal(bits(out[:, i]), bits(jaxdet.dropout(x[:, i], key, 0.5)))


def test_nested_vmap_and_grad_under_vmap():
    x = random_x((2, 3, 40), jnp.float32, seed=12)
    keys = jr.split(jr.key(14), 2)
    inner = lambda xi, ki: jax.vmap(lambda row: jaxdet.dropout(row, ki, 0.3))(xi)
    out = jax.vmap(inner)(x, keys)
    for i in range(2):
        for j in range(3):
            np.testing.assert_array_equal(bits(out[i, j]), bits(jaxdet.dropout(x[i, j], keys[i], 0.3)))
    grads = jax.vmap(jax.grad(lambda xi, ki: jaxdet.dropout(xi, ki, 0.3).sum()))(x, keys)
    for i in range(2):
        expected = jax.grad(lambda xi: jaxdet.dropout(xi, keys[i], 0.3).sum())(x[i])
        np.testing.assert_array_equal(bits(grads[i]), bits(expected))


@pytest.mark.parametrize("rate", [0.05, 0.1, 0.5, 0.9])
def test_keep_rate_and_mean_statistics(rate):
    n = 10**6
    x = jnp.ones((n,), jnp.float32)
    out = np.asarray(jaxdet.dropout(x, jr.key(int(rate * 100)), rate), np.float64)
    q = 1.0 - rate
    kept = np.count_nonzero(out) / n
    sigma = np.sqrt(q * (1 - q) / n)
    assert abs(kept - q) < 5 * sigma, (kept, q, sigma)
    scale = float(keep_scale(rate))
    mean_sigma = scale * sigma
    assert abs(out.mean() - 1.0) < 5 * mean_sigma + 1e-6, out.mean()


# ---- GPU: the same bits as the CPU (run with `pytest -m gpu`). ----

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bits_equal_cpu_bits(cpu, gpu, dtype):
    key = np.asarray(jr.key(31337))
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, 7e4], np.float32)
    for shape, offset in [((3, 1000, 77), 0), ((12345,), 3), ((2, 4097), 2**35 + 6), ((1,), 1)]:
        x = np.array(random_x(shape, dtype, seed=shape[0]))  # a writable copy
        with np.errstate(over="ignore"):
            x.ravel()[: specials.size] = specials[: x.size].astype(x.dtype)
        run = lambda d: np.asarray(jax.jit(lambda x, k: jaxdet.dropout(x, k, 0.3, offset=offset))(
            jax.device_put(x, d), jax.device_put(key, d)))
        np.testing.assert_array_equal(bits(run(gpu)), bits(run(cpu)))
        np.testing.assert_array_equal(bits(run(gpu)), bits(reference(x, key, 0.3, offset)))


@pytest.mark.gpu
def test_gpu_vmap_grad_and_misaligned_slices_equal_cpu(cpu, gpu):
    x = np.asarray(random_x((4, 3001), jnp.bfloat16, seed=21))
    keys = np.asarray(jr.split(jr.key(5), 4))
    f = jax.jit(jax.vmap(jax.grad(lambda xi, ki: (jaxdet.dropout(xi, ki, 0.4).astype(jnp.float32) ** 2).sum())))
    on = lambda d: np.asarray(f(jax.device_put(x, d), jax.device_put(keys, d)))
    np.testing.assert_array_equal(bits(on(gpu)), bits(on(cpu)))
    flat = jax.device_put(x.ravel(), gpu)
    whole = bits(jaxdet.dropout(flat, jax.device_put(keys[0], gpu), 0.4))
    for a, b in [(1, 9000), (3, 12004), (7, 8)]:  # misaligned starts take the scalar edge path
        part = jaxdet.dropout(flat[a:b], jax.device_put(keys[0], gpu), 0.4, offset=a)
        np.testing.assert_array_equal(bits(part), whole[a:b])


@pytest.mark.gpu
def test_gpu_more_than_2_31_elements_index_with_64_bits(gpu):
    rows, cols = 2**19 + 1, 4096  # 2**31 + 4096 elements
    key = jax.device_put(np.asarray(jr.key(77)), gpu)
    x = jnp.ones((rows * cols,), jnp.bfloat16, device=gpu)
    out = jax.jit(lambda x, k: jaxdet.dropout(x, k, 0.5))(x, key).reshape(rows, cols)
    for r in (0, 2**19 - 1, 2**19):  # the last row starts at element 2**31
        expected = reference(np.ones(cols, ml_dtypes.bfloat16), np.asarray(key), 0.5, offset=r * cols)
        np.testing.assert_array_equal(bits(out[r]), bits(expected), err_msg=f"row {r}")
