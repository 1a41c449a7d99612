"""jaxdet.nnx and the NNX Llama on 8 simulated CPU devices (docs/flax.md): this file reruns itself in
a child pytest when this process has fewer (tests/multidevice.py)."""

import jax
import jax.numpy as jnp
import pytest
from bitwise import assert_bitwise
from jax.sharding import PartitionSpec as P
from multidevice import mesh, on_devices, put

nnx = pytest.importorskip("flax.nnx")

import jaxdet  # noqa: E402
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


@on_devices
@pytest.mark.parametrize("masked", [False, True], ids=["kernel", "masked"])
def test_norm_parameter_gradients_inside_shard_map_are_one_devices(masked):
    # Every device holds one whole chunk of jaxdet.sum.CHUNK_TOKENS tokens, so the devices' partial
    # parameter gradients meet by the canonical tree into one device's bits (docs/reduce.md).
    tokens = 8 * jaxdet.sum.CHUNK_TOKENS
    layer = jnnx.LayerNorm(4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (tokens, 4))
    g = jax.random.normal(jax.random.key(1), (tokens, 4))
    mask = jax.random.bernoulli(jax.random.key(2), 0.8, (tokens, 4)).at[:, 0].set(True) if masked else None
    graphdef, params = nnx.split(layer)

    def grads(params, x, g, mask):
        return jax.grad(lambda p: jnp.vdot(nnx.merge(graphdef, p)(x, mask=mask), g))(params)

    want = jax.jit(grads)(params, x, g, mask)
    mask_spec = P("data") if masked else None
    in_map = jax.jit(jax.shard_map(grads, mesh=mesh(), in_specs=(P(), P("data"), P("data"), mask_spec), out_specs=P()))
    assert_bitwise(in_map(params, x, g, mask), want, "scale and bias gradients over 8 devices")


@on_devices
def test_dropout_example_offset_inside_shard_map_draws_the_whole_batch_mask():
    layer = jnnx.Dropout(0.4, deterministic=False)
    x = jax.random.normal(jax.random.key(0), (16, 6, 8))
    key = jax.random.key(2)
    want = layer(x, rngs=key)

    def per_device(x):  # two examples per device: the first is example 2 * device index
        return layer(x, rngs=key, example_offset=2 * jax.lax.axis_index("data"))

    got = jax.jit(jax.shard_map(per_device, mesh=mesh(), in_specs=P("data"), out_specs=P("data")))(x)
    assert_bitwise(got, want, "each device's examples, by their global index")
