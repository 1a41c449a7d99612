"""jaxdet.nnx and the NNX Llama on 8 simulated CPU devices (docs/flax.md): this file reruns itself in
a child pytest when this process has fewer (tests/multidevice.py)."""

import jax
import jax.numpy as jnp
import pytest
from bitwise import assert_bitwise
from jax.sharding import PartitionSpec as P
from multidevice import mesh, on_devices, put

nnx = pytest.importorskip("flax.nnx")

import jaxdet.nnx as jnnx  # noqa: E402
from jaxdet.models.llama import Llama, LlamaConfig  # noqa: E402

TINY = LlamaConfig(vocab_size=97, d_model=128, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=256, max_len=16)


@on_devices
def test_llama_logits_and_extend_with_the_batch_sharded_have_one_devices_bits():
    model = Llama(TINY, rngs=nnx.Rngs(0))
    t = jax.random.randint(jax.random.key(1), (8, 12), 0, TINY.vocab_size, jnp.int32)
    forward = nnx.jit(lambda m, t: m(t))
    extend = nnx.jit(lambda m, t, p, c: m.extend(t, p, c))
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (8, 12))
    want = forward(model, t)
    want_ext, _ = extend(model, t, positions, model.init_cache(8, 16))
    m = mesh()
    sharded = put(t, m, P("data"))
    assert_bitwise(forward(model, sharded), want, "logits, the batch over 8 devices")
    cache = jax.tree.map(lambda a: put(a, m, P("data")), model.init_cache(8, 16))
    got_ext, _ = extend(model, sharded, put(positions, m, P("data")), cache)
    assert_bitwise(got_ext, want_ext, "extend, the batch and the cache over 8 devices")
    assert_bitwise(got_ext, want, "extend's logits are the forward's")


@on_devices
def test_dropout_of_a_sharded_batch_is_the_unsharded_mask():
    layer = jnnx.Dropout(0.4, deterministic=False)
    x = jax.random.normal(jax.random.key(0), (16, 6, 8))
    key = jax.random.key(2)
    call = nnx.jit(lambda layer, x: layer(x, rngs=key))
    assert_bitwise(call(layer, put(x, mesh(), P("data"))), call(layer, x), "sharded over the examples")
