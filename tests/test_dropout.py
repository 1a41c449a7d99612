"""jaxdet.dropout: each test proves one contract of docs/dropout.md."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from bitwise import bits
from jax.test_util import check_grads

import jaxdet
from jaxdet import random as jr
from jaxdet._src.dropout import contracts
from jaxdet._src.dropout.dropout import drop_threshold, keep_scale
from jaxdet._src.dropout.reference import keep_mask

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


random_x = contracts.random_x


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
    cuts = ((0, 1), (1, 2), (3, 11), (5, 4000), (17, 4112), (4096, 4112), (4111, 4112))
    ok, detail = contracts.check_slicing(dtype, (16, 257), cuts)
    assert ok, detail


def test_mask_does_not_depend_on_dtype():
    ok, detail = contracts.check_dtypes((33, 65), 0.25)
    assert ok, detail


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
    for out in (
        jaxdet.dropout(x, jr.key(0), 0.0),
        jaxdet.dropout(x, jr.key(0), 0.7, deterministic=True),
        jaxdet.dropout(x, None, 0.5, deterministic=True),
        jaxdet.dropout(x, None, 0.0),
    ):
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
            bits(jaxdet.dropout(y, key, 0.4, broadcast_dims=(0,))), bits(jaxdet.dropout(y, key, 0.4))
        )


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
    ok, detail = contracts.check_keep_rate((rate,))
    assert ok, detail


# ---- GPU: the same bits as the CPU (run with `pytest -m gpu`). ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bits_equal_cpu_bits(cpu, gpu, dtype):
    cases = (((3, 1000, 77), 0), ((12345,), 3), ((2, 4097), 2**35 + 6), ((1,), 1))
    ok, detail = contracts.check_cpu_vs_gpu(dtype, cases)
    assert ok, detail
    key = np.asarray(jr.key(3))
    for shape, offset in cases:  # and both equal the documented NumPy reference
        x = np.array(contracts.random_x(shape, dtype, seed=shape[0]))
        with np.errstate(over="ignore"):
            x.ravel()[: contracts.SPECIALS.size] = contracts.SPECIALS[: x.size].astype(x.dtype)
        got = jax.jit(lambda x, k, offset=offset: jaxdet.dropout(x, k, 0.3, offset=offset))(
            jax.device_put(x, gpu), jax.device_put(key, gpu)
        )
        np.testing.assert_array_equal(bits(got), bits(reference(x, key, 0.3, offset)))


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


# ---- Traced offsets (the offset is an operand of the kernel, not an attribute). ----


def test_traced_offset_gives_the_static_masks():
    x = random_x((6, 333), jnp.bfloat16, seed=30)
    key = jr.key(41)
    traced = jax.jit(lambda x, k, o: jaxdet.dropout(x, k, 0.3, offset=o))
    for offset in (0, 1, 7, 2**31 - 5):
        static = bits(jaxdet.dropout(x, key, 0.3, offset=offset))
        np.testing.assert_array_equal(bits(traced(x, key, jnp.int32(offset))), static)
        np.testing.assert_array_equal(bits(traced(x, key, jnp.uint32(offset))), static)
    with jax.enable_x64(True):  # int64 offsets keep the 64-bit index (counters with a non-zero high word)
        for offset in (2**33 + 1, 2**62 + 3):
            got = traced(x, key, jnp.asarray(offset, jnp.int64))
            np.testing.assert_array_equal(bits(got), bits(reference(x, key, 0.3, offset)))
    # A concrete device array is taken as an operand too.
    np.testing.assert_array_equal(
        bits(jaxdet.dropout(x, key, 0.3, offset=jnp.int32(9))), bits(jaxdet.dropout(x, key, 0.3, offset=9))
    )


def test_scanned_micro_batches_draw_the_whole_batch_mask():
    # Idiom: lax.scan over micro-batches, each passing its global position as a traced offset.
    x = random_x((8, 4, 129), jnp.float32, seed=31)  # 8 micro-batches of 4 x 129
    key = jr.key(42)
    per_batch = x[0].size

    def step(carry, xi_i):
        xi, i = xi_i
        return carry, jaxdet.dropout(xi, key, 0.25, offset=i * per_batch)

    _, out = jax.lax.scan(step, 0, (x, jnp.arange(8, dtype=jnp.int32)))
    np.testing.assert_array_equal(bits(out), bits(jaxdet.dropout(x, key, 0.25)))
    # The backward regenerates each micro-batch's mask from its traced offset.
    grads = jax.grad(
        lambda x: jax.lax.scan(
            lambda c, a: (c + jnp.sum(step(0, a)[1] ** 2), None), 0.0, (x, jnp.arange(8, dtype=jnp.int32))
        )[0]
    )(x)
    whole = jax.grad(lambda x: jnp.sum(jaxdet.dropout(x, key, 0.25) ** 2))(x)
    np.testing.assert_array_equal(bits(grads), bits(whole))


def test_vmap_over_traced_offsets_and_broadcast_dims():
    x = random_x((5, 3, 40), jnp.float16, seed=32)
    key = jr.key(43)
    offsets = jnp.asarray([0, 3, 17, 2**20 + 1, 2**31 - 1], jnp.int32)
    out = jax.vmap(lambda xi, o: jaxdet.dropout(xi, key, 0.4, offset=o, broadcast_dims=(0,)))(x, offsets)
    for i in range(5):
        expected = jaxdet.dropout(x[i], key, 0.4, offset=int(offsets[i]), broadcast_dims=(0,))
        np.testing.assert_array_equal(bits(out[i]), bits(expected))
    # A batched offset with a batched key, and a batched offset with x shared.
    keys = jr.split(key, 5)
    out = jax.vmap(lambda xi, k, o: jaxdet.dropout(xi, k, 0.4, offset=o))(x, keys, offsets)
    shared = jax.vmap(lambda o: jaxdet.dropout(x[0], key, 0.4, offset=o))(offsets)
    for i in range(5):
        np.testing.assert_array_equal(bits(out[i]), bits(jaxdet.dropout(x[i], keys[i], 0.4, offset=int(offsets[i]))))
        np.testing.assert_array_equal(bits(shared[i]), bits(jaxdet.dropout(x[0], key, 0.4, offset=int(offsets[i]))))


def test_bad_traced_offsets_raise():
    x = jnp.ones((8,), jnp.float32)
    key = jr.key(0)
    for bad in (jnp.float32(1.0), jnp.ones((2,), jnp.int32), jnp.bool_(True)):
        with pytest.raises(TypeError, match="offset"):
            jax.jit(lambda o: jaxdet.dropout(x, key, 0.5, offset=o))(bad)


# ---- The CPU kernel runs on XLA's intra-op thread pool: the bits cannot depend on the split. ----


def test_multithreaded_cpu_kernel_matches_the_reference():
    # Many 2^16-element work items, groups straddling item boundaries (vmap gives each example its
    # own key and offset), the contiguous and the strided (broadcast_dims) paths.
    x = random_x((3, 100003), jnp.bfloat16, seed=33)
    keys = jr.split(jr.key(44), 3)
    offsets = jnp.asarray([5, 2**31 + 1, 0], jnp.uint32)
    out = jax.vmap(lambda xi, k, o: jaxdet.dropout(xi, k, 0.5, offset=o))(x, keys, offsets)
    for i in range(3):
        np.testing.assert_array_equal(bits(out[i]), bits(reference(x[i], keys[i], 0.5, int(offsets[i]))))
    y = random_x((4, 70001, 2), jnp.float32, seed=34)
    out = np.asarray(jaxdet.dropout(y, keys[0], 0.5, broadcast_dims=(2,)))
    keep = keep_mask(np.asarray(keys[0]), 4 * 70001, 0.5).reshape(4, 70001, 1)
    expected = np.where(keep, (np.asarray(y) * keep_scale(0.5)).astype(np.float32), np.float32(0))
    np.testing.assert_array_equal(bits(out), bits(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_traced_offsets_equal_cpu(cpu, gpu, dtype):
    # Each group's offset is read from device memory, so every alignment of a group's first
    # 16-byte chunk occurs; vmap gives every example its own key and offset.
    x = np.asarray(random_x((6, 3001), dtype, seed=40))
    keys = np.asarray(jr.split(jr.key(45), 6))
    offsets = np.asarray([0, 1, 7, 9, 2**31 + 3, 2**32 - 2], np.uint32)
    f = jax.jit(jax.vmap(lambda xi, k, o: jaxdet.dropout(xi, k, 0.3, offset=o)))
    on = lambda d: np.asarray(f(*(jax.device_put(v, d) for v in (x, keys, offsets))))
    got = on(gpu)
    np.testing.assert_array_equal(bits(got), bits(on(cpu)))
    for i in range(6):
        np.testing.assert_array_equal(bits(got[i]), bits(reference(x[i], keys[i], 0.3, int(offsets[i]))))
    # The strided kernel (broadcast_dims) with a traced offset; and a 64-bit traced offset.
    g = jax.jit(lambda x, k, o: jaxdet.dropout(x, k, 0.3, offset=o, broadcast_dims=(0,)))
    on = lambda d: np.asarray(g(*(jax.device_put(v, d) for v in (x, keys[0], np.int32(12345)))))
    np.testing.assert_array_equal(bits(on(gpu)), bits(on(cpu)))
    with jax.enable_x64(True):
        h = jax.jit(lambda x, k, o: jaxdet.dropout(x, k, 0.3, offset=o))
        on = lambda d: np.asarray(h(*(jax.device_put(v, d) for v in (x, keys[0], np.int64(2**35 + 6)))))
        np.testing.assert_array_equal(bits(on(gpu)), bits(reference(x, keys[0], 0.3, 2**35 + 6)))


@pytest.mark.gpu
def test_gpu_scanned_micro_batches_equal_the_whole_batch(gpu):
    x = jax.device_put(np.asarray(random_x((4, 8, 1001), jnp.bfloat16, seed=41)), gpu)
    key = jax.device_put(np.asarray(jr.key(46)), gpu)
    n = 8 * 1001  # not a multiple of 8: micro-batches start mid 16-byte chunk

    def micro(c, xi_i):
        xi, i = xi_i
        return c, jaxdet.dropout(xi, key, 0.5, offset=i * n)

    _, out = jax.jit(lambda x: jax.lax.scan(micro, 0, (x, jnp.arange(4, dtype=jnp.int32))))(x)
    np.testing.assert_array_equal(bits(out), bits(jaxdet.dropout(x, key, 0.5)))


def test_forward_mode_applies_the_same_mask():
    # Dropout is linear in x: its tangent is the same mask applied to the tangent, bit for bit.
    x, t = jnp.ones((4, 8), jnp.float32), jnp.arange(32, dtype=jnp.float32).reshape(4, 8)
    key = jaxdet.random.key(3)
    tangent = jax.jvp(lambda x: jaxdet.dropout(x, key, 0.5), (x,), (t,))[1]
    np.testing.assert_array_equal(bits(tangent), bits(jaxdet.dropout(t, key, 0.5)))
