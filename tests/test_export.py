"""jax.export of functions using jaxdet (docs/export.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdet
from jaxdet.testing import assert_bitwise_equal


def _step(w, x, key):
    def loss(w):
        h = jaxdet.dropout(jaxdet.matmul(x, w), key, 0.25)
        return jnp.sum(h.astype(jnp.float32) ** 2)

    g = jax.grad(loss)(w)
    g, norm = jaxdet.clip_by_global_norm(g, 1.0)
    return w - 0.1 * g, norm


def _args():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((16, 64)), jnp.bfloat16)
    return w, x, jaxdet.random.key(3)


def test_export_serialize_roundtrip_is_bitwise():
    args = _args()
    exported = jax.export.export(jax.jit(_step), disabled_checks=jaxdet.export.disabled_checks())(*args)
    restored = jax.export.deserialize(exported.serialize())
    for got, want in zip(restored.call(*args), jax.jit(_step)(*args)):
        assert_bitwise_equal(got, want, "exported step")


def test_export_without_disabled_checks_names_a_jaxdet_target():
    with pytest.raises(ValueError, match="jaxdet_"):
        jax.export.export(jax.jit(_step))(*_args())


def test_disabled_checks_cover_every_registered_target():
    names = jaxdet.export.target_names()
    assert "jaxdet_gemm" in names and "jaxdet_dropout" in names and "jaxdet_clip_global_norm" in names
    assert len(jaxdet.export.disabled_checks()) == len(names)
