"""jaxdet.invariant on 8 simulated CPU devices: a user's own `shard_map` data-parallel step gives
the same gradients and optimizer state for D = 1, 2, 4, 8 (docs/invariant.md)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from multidevice import on_devices

import jaxdet
from jaxdet.models import plain_llama as L
from jaxdet.testing import assert_bitwise_equal

CFG = L.Config(d_model=32, n_heads=2, n_kv_heads=1, d_ff=32, n_layers=1, vocab=61)
T = 32


def _data():
    rows = 8 * jaxdet.invariant.CHUNK_TOKENS // T  # D = 8 devices of one chunk of tokens each
    tokens = jax.random.randint(jax.random.key(7), (rows, T + 1), 0, CFG.vocab)
    return tokens[:, :-1], tokens[:, 1:]


def _dp_step(mesh, tx, cfg=CFG):
    """The user's step, written without jaxdet: each device differentiates the mean loss of its
    shard (JAX inserts the sum over devices of the replicated parameters' gradients), the
    gradients are averaged over devices, and the optimizer updates."""
    d = mesh.devices.size

    def local(params, tokens, targets):
        loss, grads = jax.value_and_grad(functools.partial(L.loss, cfg=cfg))(params, tokens, targets)
        return jax.lax.pmean(loss, "d"), jax.tree.map(lambda g: g / d, grads)

    def step(params, opt_state, tokens, targets):
        loss, grads = jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=(P(), P()))(
            params, tokens, targets
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return step


@on_devices
def test_shard_map_data_parallel_gradients_equal_for_every_device_count():
    params = L.init(CFG, jax.random.key(3))
    tokens, targets = _data()
    tx = optax.adam(1e-2)
    results = {}
    for d in (1, 2, 4, 8):
        mesh = Mesh(np.array(jax.devices()[:d]), ("d",))
        step = jax.jit(jaxdet.invariant(_dp_step(mesh, tx)))
        results[d] = step(params, tx.init(params), tokens, targets)
    for d in (2, 4, 8):
        jax.tree.map(assert_bitwise_equal, results[d], results[1])
    # the rules did something: plain JAX's psum gives other gradients for D = 1 and D = 8
    plain = {}
    for d in (1, 8):
        mesh = Mesh(np.array(jax.devices()[:d]), ("d",))
        plain[d] = jax.jit(_dp_step(mesh, tx))(params, tx.init(params), tokens, targets)[3]
    differs = jax.tree.leaves(
        jax.tree.map(lambda a, b: not np.array_equal(np.asarray(a), np.asarray(b)), plain[1], plain[8])
    )
    assert any(differs)
    for got, want in zip(jax.tree.leaves(results[1][3]), jax.tree.leaves(plain[1])):
        err = float(jnp.linalg.norm(got - want) / jnp.maximum(jnp.linalg.norm(want), 1e-30))
        assert err < 1e-4, err


@on_devices
def test_shard_map_data_parallel_bfloat16_gradients_equal_for_every_device_count():
    """bfloat16 parameters: each device's gradient is a float32 partial sum over its chunks that
    the sum over devices continues, rounded once after it (rounding each device's partial first
    would make the bits depend on D)."""
    cfg = L.Config(d_model=32, n_heads=2, n_kv_heads=1, d_ff=32, n_layers=1, vocab=61, dtype=jnp.bfloat16)
    params = L.init(cfg, jax.random.key(5))
    tokens, targets = _data()
    tx = optax.adam(1e-2)
    results = {}
    for d in (1, 2, 8):
        mesh = Mesh(np.array(jax.devices()[:d]), ("d",))
        results[d] = jax.jit(jaxdet.invariant(_dp_step(mesh, tx, cfg)))(params, tx.init(params), tokens, targets)
    for d in (2, 8):
        jax.tree.map(assert_bitwise_equal, results[d], results[1])


@on_devices
def test_shard_map_outside_and_sharded_jit_give_the_single_device_bits():
    """jaxdet.invariant inside the user's shard_map (each device transforms its own step, psum
    of the gradients in it), and sharded jit of the transformed step (the batch split over 8
    devices by in_shardings): both give the single-device gradients."""
    params = L.init(CFG, jax.random.key(3))
    tokens, targets = _data()
    loss = functools.partial(L.loss, cfg=CFG)
    single = jax.jit(jax.grad(jaxdet.invariant(loss)))(params, tokens, targets)

    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))

    def local(params, tokens, targets):
        grads = jax.grad(loss)(jax.tree.map(lambda p: jax.lax.pcast(p, "d", to="varying"), params), tokens, targets)
        return jax.tree.map(lambda g: jax.lax.psum(g, "d") / 8, grads)

    inside = jax.jit(jax.shard_map(jaxdet.invariant(local), mesh=mesh, in_specs=(P(), P("d"), P("d")), out_specs=P()))(
        params, tokens, targets
    )
    jax.tree.map(assert_bitwise_equal, inside, single)

    batch = jax.sharding.NamedSharding(mesh, P("d"))
    sharded = jax.jit(jax.grad(jaxdet.invariant(loss)))(
        params, jax.device_put(tokens, batch), jax.device_put(targets, batch)
    )
    jax.tree.map(assert_bitwise_equal, sharded, single)


@on_devices
def test_psum_pmean_and_psum_scatter_by_the_canonical_tree():
    """Inside shard_map: psum is jaxdet.parallel's tree over the devices (float32 for bfloat16),
    pmean that tree divided by the device count, psum_scatter this device's slice of it."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("d",))
    x = jax.random.normal(jax.random.key(9), (8, 16, 3), jnp.float32)

    def body(x):
        v = x[0]
        return (
            jax.lax.psum(v, "d")[None],
            jax.lax.pmean(v, "d")[None],
            jax.lax.psum_scatter(v, "d", scatter_dimension=0, tiled=True)[None],
            jax.lax.psum(v.astype(jnp.bfloat16), "d")[None],
        )

    f = jax.jit(jaxdet.invariant(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))))
    psum, pmean, scattered, half = f(x)
    tree = jaxdet.parallel.tree_sum([x[i] for i in range(8)])
    for i in range(8):
        assert_bitwise_equal(psum[i], tree)
        assert_bitwise_equal(pmean[i], tree / 8)
        assert_bitwise_equal(scattered[i], tree[2 * i : 2 * i + 2])
        want = jaxdet.parallel.tree_sum([x[j].astype(jnp.bfloat16).astype(jnp.float32) for j in range(8)])
        assert_bitwise_equal(half[i], want.astype(jnp.bfloat16))


@pytest.mark.gpu
def test_gpu_shard_map_data_parallel_on_real_gpus_equals_one_gpu():
    """On 2 or 4 real GPUs (a multi-GPU machine; skipped with one): the user's shard_map
    data-parallel step, with jaxdet's fused attention in it (head dimension 64) and bfloat16
    parameters, gives one GPU's gradients and optimizer state bit for bit."""
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs 2 or more GPUs")
    cfg = L.Config(d_model=128, n_heads=2, n_kv_heads=1, d_ff=256, n_layers=2, vocab=97, dtype=jnp.bfloat16)
    rows = 4 * jaxdet.invariant.CHUNK_TOKENS // T
    tokens = jax.random.randint(jax.random.key(8), (rows, T + 1), 0, cfg.vocab)
    params = L.init(cfg, jax.random.key(4))
    tx = optax.adam(1e-2)
    results = {}
    for d in (n for n in (1, 2, 4) if n <= len(gpus)):
        mesh = Mesh(np.array(gpus[:d]), ("d",))
        step = jax.jit(jaxdet.invariant(_dp_step(mesh, tx, cfg)))
        results[d] = jax.device_get(step(params, tx.init(params), tokens[:, :-1], tokens[:, 1:]))
    for got in results.values():
        jax.tree.map(assert_bitwise_equal, got, results[1])
