"""Philox4x32-10 and key derivation (contracts in docs/random.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdet
from jaxdet import random as jr
from jaxdet._src.dropout import contracts
from jaxdet._src.dropout.reference import philox4x32_10 as np_philox


def test_known_answer_vectors_cpu(cpu):
    ok, detail = contracts.check_kat(cpu)
    assert ok, detail


@pytest.mark.gpu
def test_known_answer_vectors_gpu(gpu):
    ok, detail = contracts.check_kat(gpu)
    assert ok, detail


def test_block_function_matches_independent_reference():
    rng = np.random.default_rng(0)
    counters = rng.integers(0, 2**32, size=(3, 257, 4), dtype=np.uint64).astype(np.uint32)
    key = np.array([0x12345678, 0x9ABCDEF0], np.uint32)
    out = np.asarray(jr.philox4x32_10(counters, key))
    np.testing.assert_array_equal(out, np_philox(counters, key))


@pytest.mark.gpu
def test_block_function_gpu_equals_cpu(cpu, gpu):
    rng = np.random.default_rng(1)
    counters = rng.integers(0, 2**32, size=(4099, 4), dtype=np.uint64).astype(np.uint32)
    key = np.array([7, 11], np.uint32)
    on_cpu = np.asarray(jr.philox4x32_10(jax.device_put(counters, cpu), jax.device_put(key, cpu)))
    on_gpu = np.asarray(jr.philox4x32_10(jax.device_put(counters, gpu), jax.device_put(key, gpu)))
    np.testing.assert_array_equal(on_cpu, on_gpu)


def test_key_layout():
    assert np.asarray(jr.key(0)).tolist() == [0, 0]
    assert np.asarray(jr.key(42)).tolist() == [42, 0]
    assert np.asarray(jr.key(2**32 + 5)).tolist() == [5, 1]
    assert np.asarray(jr.key(-1)).tolist() == [0xFFFFFFFF, 0xFFFFFFFF]
    assert jr.key(3).dtype == jnp.uint32 and jr.key(3).shape == (2,)
    # A traced seed gives the same key as the Python int.
    assert np.asarray(jax.jit(jr.key)(jnp.int32(-7))).tolist() == np.asarray(jr.key(-7)).tolist()
    assert np.asarray(jax.jit(jr.key)(jnp.uint32(9))).tolist() == [9, 0]


def test_fold_in_and_split_are_documented_philox_calls():
    key = jr.key(1234)
    k = np.asarray(key)
    for data in (0, 1, 77, 2**40 + 3):
        counter = np.array([[data & 0xFFFFFFFF, data >> 32, jr.FOLD_TAG, 0]], np.uint32)
        expected = np_philox(counter, k)[0, :2]
        np.testing.assert_array_equal(np.asarray(jr.fold_in(key, data)), expected)
    keys = np.asarray(jr.split(key, 5))
    assert keys.shape == (5, 2) and keys.dtype == np.uint32
    for i in range(5):
        np.testing.assert_array_equal(keys[i], np.asarray(jr.fold_in(key, i)))
    assert len({tuple(row) for row in keys.tolist()}) == 5
    # Under jit and vmap the derivations are the same function.
    np.testing.assert_array_equal(np.asarray(jax.jit(jr.split, static_argnums=1)(key, 5)), keys)
    batched = jax.vmap(lambda kk: jr.fold_in(kk, 3))(jnp.asarray(keys))
    for i in range(5):
        np.testing.assert_array_equal(np.asarray(batched[i]), np.asarray(jr.fold_in(keys[i], 3)))
    traced = jax.jit(jr.fold_in)(key, jnp.uint32(77))
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(jr.fold_in(key, 77)))


def test_from_jax_key():
    jk = jax.random.key(0)
    data = np.asarray(jax.random.key_data(jk))
    counter = np.array([[data[0], data[1], jr.JAX_TAG, 0]], np.uint32)
    expected = np_philox(counter, np.zeros(2, np.uint32))[0, :2]
    np.testing.assert_array_equal(np.asarray(jr.from_jax_key(jk)), expected)
    # Raw (legacy) uint32 keys and batches of keys.
    np.testing.assert_array_equal(np.asarray(jr.from_jax_key(jax.random.PRNGKey(0))), expected)
    many = jr.from_jax_key(jax.random.split(jk, 4))
    assert many.shape == (4, 2) and many.dtype == jnp.uint32
    with pytest.raises(TypeError, match="jax_key"):
        jr.from_jax_key(jnp.zeros((2,), jnp.float32))


def test_bad_keys_are_rejected_with_how_to():
    x = jnp.ones((8,), jnp.float32)
    with pytest.raises(TypeError, match="from_jax_key"):
        jaxdet.dropout(x, jax.random.key(0), 0.5)
    with pytest.raises(TypeError, match=r"uint32\[2\]"):
        jaxdet.dropout(x, jnp.zeros((3,), jnp.uint32), 0.5)
    with pytest.raises(TypeError, match=r"jaxdet.random.key\(seed\)"):
        jaxdet.dropout(x, jnp.zeros((2,), jnp.int32), 0.5)
    with pytest.raises(TypeError, match="Philox key"):
        jaxdet.dropout(x, 123, 0.5)
    with pytest.raises(TypeError, match=r"uint32\[\.\.\., 4\]"):
        jr.philox4x32_10(jnp.zeros((3,), jnp.uint32), jr.key(0))
    with pytest.raises(ValueError, match="num"):
        jr.split(jr.key(0), -1)
    with pytest.raises(ValueError, match="seed"):
        jr.key(2**64)
