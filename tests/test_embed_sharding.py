"""jaxdet.embed and jaxdet.segment_sum on many devices (docs/embed.md, "Many devices"), on 8
simulated CPU devices: this file reruns itself in a child pytest when this process has fewer
(tests/multidevice.py), so the single-device tests live in tests/test_embed.py."""

import jax
import jax.numpy as jnp
import pytest
from bitwise import assert_bitwise
from jax.sharding import PartitionSpec as P
from multidevice import collectives, mesh, on_devices, partitioner, put

import jaxdet
from jaxdet import parallel
from jaxdet._src.embed.contracts import rand, random_ids

C = jaxdet.embed.CHUNK_TOKENS
V, D = 48, 8


def _loss(table, ids):
    return jnp.sum(jnp.sin(jaxdet.embed(table, ids).astype(jnp.float32)))


@on_devices
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_table_gradient_is_device_count_invariant(dtype):
    # Every device holds 2^j whole chunks: jax.grad inside shard_map (the replicated table's
    # cotangent meets by the canonical tree, tree_psum), sharded jit (tokens split: tree_psum of the
    # devices' float32 partials) and segment_sum per device + tree_psum give one device's bits.
    table = rand((V, D), dtype, seed=1)
    ids = random_ids((8, C), V, seed=2)  # 8 chunks
    reference = jax.jit(jax.grad(_loss))(table, ids)
    for d in (1, 2, 4, 8):
        m = mesh(d)
        in_shard_map = jax.jit(jax.shard_map(jax.grad(_loss), mesh=m, in_specs=(P(), P("data")), out_specs=P()))
        assert_bitwise(in_shard_map(table, ids), reference, f"shard_map, {d} devices")
        td, idd = put(table, m, P()), put(ids, m, P("data"))
        assert_bitwise(jax.jit(jax.grad(_loss))(td, idd), reference, f"sharded jit, {d} devices")
        if d > 1:  # the partials meet by data movement only (all_to_all + all_gather), no psum
            found = collectives(jax.grad(_loss), td, idd)
            assert "all-reduce" not in found and "reduce-scatter" not in found, found
        g = jnp.cos(jaxdet.embed(table, ids).astype(jnp.float32)).astype(dtype)
        per_device = jax.jit(
            jax.shard_map(
                lambda g, i: parallel.tree_psum(
                    jaxdet.segment_sum(g, i, V, preferred_element_type=jnp.float32), "data"
                ),
                mesh=m,
                in_specs=(P("data"), P("data")),
                out_specs=P(),
            )
        )
        assert_bitwise(per_device(g, ids).astype(dtype), reference, f"segment_sum + tree_psum, {d} devices")


@on_devices
@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_sharded_jit_splits(shardy):
    table = rand((V, D), jnp.float32, seed=3)
    ids = random_ids((8, C // 4), V, seed=4)  # 2 chunks: 8 devices hold a quarter chunk each
    grad = jax.grad(_loss)
    reference = jax.jit(grad)(table, ids)
    m = mesh()
    with partitioner(shardy):
        # Tokens that do not line up with whole chunks are all-gathered: still one device's bits.
        dw = jax.jit(grad)(put(table, m, P()), put(ids, m, P("data")))
        assert_bitwise(dw, reference, "tokens split mid-chunk")
        # Rows of the table split (vocabulary parallel): each device sums its own rows, no collective
        # in the backward, and the gradient keeps the table's sharding.
        td = put(table, m, P("data"))
        dw = jax.jit(grad)(td, ids)
        assert_bitwise(dw, reference, "rows split")
        assert dw.sharding.spec == P("data")
        # Columns split: per device, no collective at all.
        td = put(table, m, P(None, "data"))
        dw = jax.jit(grad)(td, ids)
        assert_bitwise(dw, reference, "columns split")
        assert not collectives(grad, td, ids)
        # segment_sum with its tokens split over whole chunks: the canonical tree across devices
        x = rand((8 * C, 4), jnp.bfloat16, seed=5)
        seg = random_ids((8 * C,), 30, seed=6)
        f = lambda x, i: jaxdet.segment_sum(x, i, 30)
        assert_bitwise(jax.jit(f)(put(x, m, P("data")), put(seg, m, P("data"))), jax.jit(f)(x, seg), "segment_sum")


@on_devices
def test_vmapped_and_batched_sharded_jit():
    # A batch of sequences split over devices, each example with its own table gradient (vmap):
    # the batch dimension runs per device with no collective.
    tables = rand((8, V, D), jnp.float32, seed=7)
    ids = random_ids((8, 500), V, seed=8)
    f = jax.vmap(jax.grad(_loss))
    reference = jax.jit(f)(tables, ids)
    m = mesh()
    td, idd = put(tables, m, P("data")), put(ids, m, P("data"))
    assert_bitwise(jax.jit(f)(td, idd), reference)
    assert not collectives(f, td, idd)
