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


# ---- Symbolic sequence lengths (jax.export.symbolic_shape). ----


def _export_symbolic(f, *specs):
    exported = jax.export.export(jax.jit(f), disabled_checks=jaxdet.export.disabled_checks())(*specs)
    return jax.export.deserialize(exported.serialize())


def _spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _qkv(t, s, seed=0, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (2, t, 4, 64), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (2, s, 2, 64), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (2, s, 2, 64), jnp.float32).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_exports_with_a_symbolic_sequence_length(dtype):
    """One export with symbolic batch and sequence length, called with two lengths (one KV block and
    more than one): the bits of the direct call, forward and gradients."""
    b, t = jax.export.symbolic_shape("b, t")

    def fwd(q, k, v):
        return jaxdet.attention(q, k, v)

    def grads(q, k, v):
        return jax.grad(lambda *a: jnp.sum(jaxdet.attention(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))(q, k, v)

    specs = (_spec(b, t, 4, 64, dtype=dtype), _spec(b, t, 2, 64, dtype=dtype), _spec(b, t, 2, 64, dtype=dtype))
    for f in (fwd, grads):
        restored = _export_symbolic(f, *specs)
        for length in (5, 70):
            args = _qkv(length, length, seed=length, dtype=dtype)
            assert_bitwise_equal(restored.call(*args), jax.jit(f)(*args), f"{f.__name__} T={length}")


def test_attention_decode_exports_with_a_symbolic_cache_length():
    b, s = jax.export.symbolic_shape("b, s")

    def decode(q, k, v, pos, lengths):
        return jaxdet.attention(q, k, v, q_positions=pos, kv_lengths=lengths)

    restored = _export_symbolic(
        decode,
        _spec(b, 1, 4, 64),
        _spec(b, s, 2, 64),
        _spec(b, s, 2, 64),
        _spec(b, 1, dtype=jnp.int32),
        _spec(b, dtype=jnp.int32),
    )
    for cache in (16, 600):
        q, k, v = _qkv(1, cache, seed=cache)
        pos = jnp.array([[cache // 2], [cache - 1]], jnp.int32)
        args = (q, k, v, pos, pos[:, 0] + 1)
        assert_bitwise_equal(restored.call(*args), jax.jit(decode)(*args), f"decode S={cache}")


def test_attention_on_cuda_with_symbolic_shapes_is_a_clear_error():
    """The CUDA kernels' workspace is sized when the program is compiled: symbolic shapes are refused
    there naming the argument (checked on the sizing function itself, so that it runs without a GPU)."""
    from jaxdet._src.attention import attention as impl

    (t,) = jax.export.symbolic_shape("t")
    q = jax.core.ShapedArray((2, t, 2, 2, 64), jnp.bfloat16)
    k = jax.core.ShapedArray((2, t, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"on CUDA needs static shapes: q has symbolic dimension\(s\) t"):
        impl._workspace("fwd")([q, k, k], scale=1.0, row_form=impl.CAUSAL_POSITIONS)


def test_attention_forward_mode_with_symbolic_shapes_is_a_clear_error():
    """Reverse mode exports with a symbolic length (above: the backward kernel alone runs); forward
    mode's tangent products need static shapes and say so, naming the dimension."""
    b, t = jax.export.symbolic_shape("b, t")

    def tangent(q, k, v):
        return jax.jvp(jaxdet.attention, (q, k, v), (q, k, v))[1]

    specs = (_spec(b, t, 4, 64), _spec(b, t, 2, 64), _spec(b, t, 2, 64))
    with pytest.raises(NotImplementedError, match=r"forward-mode .* jaxdet.attention needs static shapes.* t"):
        jax.export.export(jax.jit(tangent), disabled_checks=jaxdet.export.disabled_checks())(*specs)
