"""Clipping a sharded tree (docs/clipping.md, "Sharded trees"), on 8 simulated CPU devices.

* ``jax.shard_map``: ``clip_by_global_norm(..., axis_name=...)``, ``global_norm(..., axis_name=...)``
  and the optax transform give the unsharded call's bits, with the right varying-axes types, under
  jit, grad, vmap and scan;
* sharded ``jax.jit`` (custom_partitioning): leaves sharded on their leading dim run per shard, with
  no all-gather of leaf data and no all-reduce, and give the unsharded bits; misaligned shardings
  fall back to gathering that leaf, with the same bits.

XLA's CPU device count is fixed when the backend starts: when this process has fewer than 8
devices, the file runs itself in a child pytest with ``--xla_force_host_platform_device_count=8``
and each test here reports the child's outcome.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multidevice import IN_CHILD as HERE  # noqa: F401
from multidevice import NDEV, partitioner
from multidevice import on_devices as on_8_devices

import jaxdet
from jaxdet import parallel

BF16, F16 = jnp.bfloat16, jnp.float16


def mesh_xy():
    return Mesh(np.array(jax.devices()[:NDEV]).reshape(4, 2), ("x", "y"))


def rand(shape, dtype=jnp.float32, seed=0, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    return jnp.asarray(x).astype(dtype)


def aligned_tree(seed=0):
    """Leaves whose shards hold whole 4096-element chunks on the (4, 2) mesh, and replicated ones."""
    return {
        "w": rand((4 * 4096 // 64 * 3, 64), seed=seed),  # P("x"): 3 chunks per shard
        "emb": rand((8 * 4, 1024), BF16, seed=seed + 1),  # P(("x", "y")): 1 chunk per shard
        "h": rand((4, 4096 + 4096), F16, seed=seed + 2),  # P("x"): one row of 2 chunks per shard
        "b": rand((300,), seed=seed + 3),  # replicated
        "s": rand((), seed=seed + 4),  # replicated 0-d
    }


ALIGNED_SPECS = {"w": P("x"), "emb": P(("x", "y")), "h": P("x"), "b": P(), "s": P()}


def misaligned_tree(seed=5):
    tree = aligned_tree(seed)
    tree["odd"] = rand((8, 100), seed=seed + 9)  # P("x"): 200 elements per shard
    tree["col"] = rand((2, 4096 * 4), seed=seed + 10)  # P(None, "x"): sharded on a trailing dim
    return tree


MISALIGNED_SPECS = dict(ALIGNED_SPECS, odd=P("x"), col=P(None, "x"))


def assert_tree_bits(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        assert_bitwise(g, w, jax.tree_util.keystr(path))


def assert_clip_bits(got, want):
    """Two (clipped tree, norm) results: the norms and every leaf bitwise equal."""
    assert_bitwise(got[1], want[1])
    assert_tree_bits(got[0], want[0])


def collectives(hlo: str):
    """(op, result element count) of every collective in a compiled module's text."""
    found = []
    for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
        for m in re.finditer(rf"= ([a-z0-9]+)\[([0-9,]*)\][^=]*? {op}(?:-start)?\(", hlo):
            found.append((op, int(np.prod([int(d) for d in m.group(2).split(",") if d] or [1]))))
    return found


# ---- shard_map: axis_name= ----------------------------------------------------------------------


@on_8_devices
@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_shard_map_axis_name_gives_the_unsharded_bits(policy):
    mesh = mesh_xy()
    for tree, specs in ((aligned_tree(), ALIGNED_SPECS), (misaligned_tree(), MISALIGNED_SPECS)):
        for max_norm in (1.0, 1e9):
            want = jaxdet.clip_by_global_norm(tree, max_norm, nonfinite=policy)

            def body(t):
                clipped, norm = jaxdet.clip_by_global_norm(t, max_norm, nonfinite=policy, axis_name=("x", "y"))
                return clipped, norm, jaxdet.global_norm(t, axis_name=("x", "y"))

            f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=(specs, P(), P())))
            clipped, norm, norm_only = f(tree)
            assert_clip_bits((clipped, norm), want)
            assert_bitwise(norm_only, want[1])


@on_8_devices
def test_shard_map_types_replicated_leaves_counted_once_and_one_axis():
    mesh = mesh_xy()
    tree = aligned_tree(1)
    seen = {}

    def body(t):
        clipped, norm = jaxdet.clip_by_global_norm(t, 0.5, axis_name=("x", "y"))
        seen.update({k: jax.typeof(v).mat.varying for k, v in clipped.items()})
        seen["norm"] = jax.typeof(norm).mat.varying
        return clipped, norm

    jax.shard_map(body, mesh=mesh, in_specs=(ALIGNED_SPECS,), out_specs=(ALIGNED_SPECS, P()))(tree)
    assert seen == {"w": {"x"}, "emb": {"x", "y"}, "h": {"x"}, "b": frozenset(), "s": frozenset(), "norm": frozenset()}
    # A tree sharded over one axis of the mesh, replicated over the other.
    sub = {"w": tree["w"], "b": tree["b"]}
    specs = {"w": P("x"), "b": P()}
    want = jaxdet.clip_by_global_norm(sub, 0.5)
    f = jax.shard_map(
        lambda t: jaxdet.clip_by_global_norm(t, 0.5, axis_name="x"),
        mesh=mesh,
        in_specs=(specs,),
        out_specs=(specs, P()),
    )
    assert_clip_bits(jax.jit(f)(sub), want)


@on_8_devices
def test_shard_map_collectives_are_one_gather_of_the_slots():
    mesh = mesh_xy()
    tree = aligned_tree(2)
    f = jax.jit(
        jax.shard_map(
            lambda t: jaxdet.clip_by_global_norm(t, 1.0, axis_name=("x", "y")),
            mesh=mesh,
            in_specs=(ALIGNED_SPECS,),
            out_specs=(ALIGNED_SPECS, P()),
        )
    )
    found = collectives(f.lower(tree).compile().as_text())
    local_chunks = 3 + 1 + 2 + 1 + 1  # w, emb, h, b, s on one device
    assert found == [("all-gather", NDEV * local_chunks)], found


@on_8_devices
def test_shard_map_bad_input_errors():
    mesh = mesh_xy()
    tree = {"w": rand((8, 4096))}
    with pytest.raises(ValueError, match="max_norm varies over"):
        jax.shard_map(
            lambda t, m: jaxdet.clip_by_global_norm(t, m[0], axis_name="x"),
            mesh=mesh,
            in_specs=({"w": P("x")}, P("x")),
            out_specs=({"w": P("x")}, P()),
        )(tree, jnp.ones((4,)))
    with pytest.raises(ValueError, match=r"leaf \['s'\] is a 0-d array that varies"):
        jax.shard_map(
            lambda t: jaxdet.global_norm({"s": t[0, 0]}, axis_name="x"), mesh=mesh, in_specs=(P("x"),), out_specs=P()
        )(tree["w"])
    with pytest.raises(TypeError, match="axis_name"):
        jaxdet.global_norm(tree, axis_name=3)


@on_8_devices
def test_shard_map_fsdp_train_steps_in_scan_match_one_device():
    # Parameters and gradients sharded over "x" on their leading dim (FSDP), one replicated: the
    # update clips by the global norm (axis_name) inside an optax chain, the steps run in lax.scan,
    # the optimizer state is a scan carry (its norm stays invariant). Bits equal one device's.
    optax = pytest.importorskip("optax")
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    params = {"w": rand((4 * 8, 512), seed=3), "v": rand((4 * 4096,), seed=4), "b": rand((7,), seed=5)}
    specs = {"w": P("x"), "v": P("x"), "b": P()}

    def grads(p):
        # Elementwise terms: each device's gradient of its own shards is the global gradient's
        # block, bit for bit (a shard-shaped dot could round differently). b's is replicated.
        g = jax.grad(lambda w, v: jnp.sum(jnp.tanh(3.0 * w) ** 2) + jnp.sum(jnp.sin(v)), argnums=(0, 1))
        gw, gv = g(p["w"], p["v"])
        return {"w": gw, "v": gv, "b": 2.0 * p["b"]}

    def steps(tx, params, n=3):
        def step(carry, _):
            p, s = carry
            u, s = tx.update(grads(p), s, p)
            return (optax.apply_updates(p, u), s), jaxdet.optax.last_norm(s)

        return lax.scan(step, (params, tx.init(params)), None, length=n)

    tx_one = optax.chain(jaxdet.optax.clip_by_global_norm(0.5), optax.sgd(0.1))
    (want_p, _), want_norms = jax.jit(lambda p: steps(tx_one, p))(params)
    tx_sharded = optax.chain(jaxdet.optax.clip_by_global_norm(0.5, axis_name="x"), optax.sgd(0.1))
    (got_p, _), got_norms = jax.jit(
        jax.shard_map(lambda p: steps(tx_sharded, p), mesh=mesh, in_specs=(specs,), out_specs=((specs, P()), P()))
    )(params)
    assert float(want_norms[0]) > 0.5  # the steps do clip
    assert_bitwise(got_norms, want_norms)
    assert_tree_bits(got_p, want_p)


@on_8_devices
def test_shard_map_per_example_clipping_with_vmap_and_tree_psum():
    # DP-SGD inside shard_map: per-example gradients on each device's examples, each clipped by its
    # own norm (vmap), summed by the deterministic tree_psum: the same bits as on one device.
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
    w = rand((64, 8), seed=7)
    x = rand((16, 64), seed=8)

    def per_example_clipped(w, x):
        # Products only: a per-example gradient's bits do not depend on the batch it is in (XLA's
        # vectorized transcendental functions can round differently for another batch size).
        g = jax.vmap(jax.grad(lambda w, xi: 0.5 * jnp.sum((w * xi[:, None]) ** 2)), in_axes=(None, 0))(w, x)
        clipped, norms = jax.vmap(lambda gi: jaxdet.clip_by_global_norm(gi, 0.3))(g)
        return clipped, norms

    want, want_norms = per_example_clipped(w, x)

    def body(w, x):
        # Varying weights: each example's gradient stays its own (for an invariant w, JAX's rule
        # would psum the per-example cotangents over the devices).
        clipped, norms = per_example_clipped(lax.pcast(w, ("data",), to="varying"), x)
        return clipped, norms, parallel.tree_psum(jnp.sum(clipped, axis=0), "data")

    got, norms, _summed = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P("data"), P()))
    )(w, x)
    assert_bitwise(norms, want_norms)
    assert_bitwise(got, want)


# ---- sharded jit: custom_partitioning -------------------------------------------------------------


def _put(tree, specs, mesh):
    return {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}


@on_8_devices
@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_sharded_jit_runs_per_shard_with_the_unsharded_bits(policy):
    mesh = mesh_xy()
    tree = aligned_tree(3)
    sharded = _put(tree, ALIGNED_SPECS, mesh)
    for max_norm in (0.7, 1e9):
        want, want_norm = jaxdet.clip_by_global_norm(tree, max_norm, nonfinite=policy)
        f = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, max_norm, nonfinite=policy))
        clipped, norm = f(sharded)
        assert_clip_bits((clipped, norm), (want, want_norm))
        for k in tree:
            assert clipped[k].sharding.is_equivalent_to(sharded[k].sharding, tree[k].ndim), k
        assert_bitwise(jax.jit(jaxdet.global_norm)(sharded), want_norm)
        # Only the slots move: one all-gather of one float per chunk (8 chunks on each device),
        # nothing leaf-sized, no all-reduce.
        for hlo in (
            f.lower(sharded).compile().as_text(),
            jax.jit(jaxdet.global_norm).lower(sharded).compile().as_text(),
        ):
            assert collectives(hlo) == [("all-gather", NDEV * 8)]


@on_8_devices
def test_sharded_jit_optax_step_and_traced_max_norm():
    optax = pytest.importorskip("optax")
    mesh = mesh_xy()
    tree = aligned_tree(4)
    sharded = _put(tree, ALIGNED_SPECS, mesh)
    tx = optax.chain(jaxdet.optax.clip_by_global_norm(0.25), optax.sgd(0.1))
    state = tx.init(tree)
    want_u, want_s = tx.update(tree, state, tree)
    got_u, got_s = jax.jit(tx.update)(sharded, state, sharded)
    assert_tree_bits(got_u, want_u)
    assert_bitwise(jaxdet.optax.last_norm(got_s), jaxdet.optax.last_norm(want_s))
    got = jax.jit(lambda t, m: jaxdet.clip_by_global_norm(t, m))(sharded, jnp.float32(0.25))
    assert_clip_bits(got, jaxdet.clip_by_global_norm(tree, 0.25))


@on_8_devices
def test_sharded_jit_misaligned_leaves_are_gathered_with_the_same_bits():
    mesh = mesh_xy()
    tree = misaligned_tree(6)
    sharded = _put(tree, MISALIGNED_SPECS, mesh)
    f = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, 0.5))
    assert_clip_bits(f(sharded), jaxdet.clip_by_global_norm(tree, 0.5))
    # The documented fallback: the two misaligned leaves are gathered (their data, once), then the
    # slots (8 chunks of the aligned leaves, 1 of "odd" and 8 of "col" on each device).
    assert sorted(collectives(f.lower(sharded).compile().as_text())) == sorted(
        [("all-gather", tree["odd"].size), ("all-gather", tree["col"].size), ("all-gather", NDEV * 17)]
    )


@on_8_devices
def test_sharded_jit_with_gspmd_partitioner():
    mesh = mesh_xy()
    tree = aligned_tree(7)
    with partitioner(shardy=False):
        got = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, 0.5))(_put(tree, ALIGNED_SPECS, mesh))
    assert_clip_bits(got, jaxdet.clip_by_global_norm(tree, 0.5))


@on_8_devices
def test_sharded_clipping_in_a_donated_step_needs_no_gradient_sized_buffer():
    # Sharded jit and shard_map: each device's gradient shards are its only gradient-sized
    # temporaries; clipping them (in place) adds none and copies nothing.
    mesh = Mesh(np.array(jax.devices()[:NDEV]), ("x",))
    n, size = 20, NDEV * 16384
    params = [jax.device_put(jnp.ones((size,), jnp.float32), NamedSharding(mesh, P("x"))) for _ in range(n)]

    def step(p, **kw):
        g = jax.grad(lambda p: sum(jnp.sum(jnp.sin(x)) for x in p))(p)
        g, norm = jaxdet.clip_by_global_norm(g, 1.0, **kw)
        return [a - 0.1 * b for a, b in zip(p, g)], norm

    sharded_jit = jax.jit(step, donate_argnums=0)
    in_shard_map = jax.jit(
        jax.shard_map(lambda p: step(p, axis_name="x"), mesh=mesh, in_specs=(P("x"),), out_specs=(P("x"), P())),
        donate_argnums=0,
    )
    for f in (sharded_jit, in_shard_map):
        compiled = f.lower(params).compile()
        assert compiled.memory_analysis().temp_size_in_bytes <= n * size * 4 // NDEV + 64 * 1024
        entry = compiled.as_text()
        assert not re.search(r"\bcopy\(", entry[entry.index("\nENTRY") :])
