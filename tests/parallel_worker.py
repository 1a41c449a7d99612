"""Runs jaxdet.parallel on several (simulated CPU, or GPU) devices for tests/test_parallel.py,
tests/test_multiprocess.py and the GPU sweep; the device count is fixed when JAX starts, so the tests
start this script in a subprocess (jaxdet._src.parallel.contracts.subprocess_env sets the flag).

    python parallel_worker.py collectives OUT_DIR     # tree_psum cases -> OUT_DIR/collectives.npz + .json
    python parallel_worker.py train STEPS [D ...]     # training hashes per D (tree and psum) -> JSON on stdout
    python parallel_worker.py multi PROCESS_ID NUM_PROCESSES PORT STEPS   # one process of a multi-process run
    python parallel_worker.py gpu STEPS               # D=1 vs D=2 on GPUs (tests/test_parallel.py's GPU sweep)
"""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

COLLECTIVES = (
    "all-reduce",
    "reduce-scatter",
    "all-gather",
    "all-to-all",
    "collective-permute",
)


def collectives_in(compiled_text):
    """The collective ops named in a compiled HLO module (start/done pairs count as the op)."""
    return sorted(set(re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", compiled_text)))


def _summands(seed, count, shape, dtype):
    import ml_dtypes  # noqa: F401 (bfloat16 for NumPy)

    rng = np.random.default_rng(seed)
    # A wide dynamic range, so that the order of the additions shows in the bits.
    x = rng.standard_normal((count,) + shape) * np.exp(rng.uniform(-12, 12, (count,) + shape))
    return x.astype(np.float32).astype(dtype)


def run_collectives(out_dir):
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jaxdet.parallel as jp
    from jaxdet._src.core import tree

    devices = jax.devices()
    arrays, facts = {}, {}

    def mesh(shape, names):
        return jax.sharding.Mesh(np.array(devices[: int(np.prod(shape))]).reshape(shape), names)

    def same_on_devices(out):
        shards = [np.asarray(s.data) for x in jax.tree.leaves(out) for s in x.addressable_shards]
        per_leaf = len(jax.tree.leaves(out))
        first = shards[:per_leaf]
        return all(
            a.tobytes() == b.tobytes()
            for k in range(0, len(shards), per_leaf)
            for a, b in zip(first, shards[k : k + per_leaf])
        )

    # 8 summands per case; device d of D holds summands [d*8/D, (d+1)*8/D) and reduces them with tree_sum.
    cases = {
        "f32": ((5, 7), np.float32),
        "f32_odd": ((1001,), np.float32),
        "f32_small": ((3,), np.float32),  # fewer elements than devices
        "f32_scalar": ((), np.float32),
        "bf16": ((5, 7), jnp.bfloat16),
        "f16": ((4, 9), np.float16),
    }
    for name, (shape, dtype) in cases.items():
        x = _summands(len(arrays), 8, shape, dtype)
        arrays[f"{name}_in"] = x
        for d in (1, 2, 4, 8):
            per = 8 // d

            def f(xl, per=per):
                return jp.tree_psum(jp.tree_sum([xl[i] for i in range(per)]), "d")

            out = jax.jit(jax.shard_map(f, mesh=mesh((d,), ("d",)), in_specs=P("d"), out_specs=P()))(x)
            arrays[f"{name}_D{d}"] = np.asarray(out)
            facts[f"{name}_D{d}_same_on_devices"] = same_on_devices(out)

    # A pytree of mixed dtypes (small leaves packed into one buffer per dtype; "d", large and not
    # a multiple of 8 elements, travels alone, padded).
    tree_in = {
        "a": _summands(10, 8, (5, 7), np.float32),
        "b": _summands(11, 8, (3,), jnp.bfloat16),
        "c": _summands(12, 8, (), np.float32),
        "d": _summands(13, 8, (tree._OWN_BUFFER + 3,), np.float32),
    }
    for k, v in tree_in.items():
        arrays[f"pytree_{k}_in"] = v

    def pytree_sum(t):
        per = jax.tree.leaves(t)[0].shape[0]
        return jp.tree_psum(jp.tree_sum([jax.tree.map(lambda v, i=i: v[i], t) for i in range(per)]), "d")

    for d in (1, 8):
        f = jax.shard_map(pytree_sum, mesh=mesh((d,), ("d",)), in_specs=P("d"), out_specs=P())
        out = jax.jit(f)(tree_in)
        for k, v in out.items():
            arrays[f"pytree_{k}_D{d}"] = np.asarray(v)

    # Under jax.vmap, jax.checkpoint and lax.scan inside shard_map (8 devices, one summand each),
    # with a leaf large enough to travel alone: each slice has the bits of the plain call.
    tx = {"big": _summands(14, 8, (tree._OWN_BUFFER + 5,), np.float32), "small": _summands(15, 8, (3, 5), np.float32)}
    m8 = mesh((8,), ("d",))

    def on_mesh(f):
        return jax.jit(jax.shard_map(f, mesh=m8, in_specs=P("d"), out_specs=P()))

    def pair(t):  # two trees per device: t and 2 t (exact), stacked
        return jax.tree.map(lambda v: jnp.stack([v[0], v[0] * 2]), t)

    arrays["transformed_plain"] = np.stack(
        [
            np.asarray(on_mesh(lambda t, c=c: jp.tree_psum(jax.tree.map(lambda v: v[0] * c, t), "d"))(tx)["big"])
            for c in (1, 2)
        ]
    )
    arrays["transformed_plain_small"] = np.stack(
        [
            np.asarray(on_mesh(lambda t, c=c: jp.tree_psum(jax.tree.map(lambda v: v[0] * c, t), "d"))(tx)["small"])
            for c in (1, 2)
        ]
    )
    runs = {
        "vmap": lambda t: jax.vmap(lambda u: jp.tree_psum(u, "d"))(pair(t)),
        "remat": lambda t: jax.tree.map(
            lambda *r: jnp.stack(r),
            *[jax.checkpoint(lambda u: jp.tree_psum(u, "d"))(jax.tree.map(lambda v: v[i], pair(t))) for i in (0, 1)],
        ),
        "scan": lambda t: jax.lax.scan(lambda c, u: (c, jp.tree_psum(u, "d")), 0, pair(t))[1],
    }
    for name, f in runs.items():
        out = on_mesh(f)(tx)
        arrays[f"transformed_{name}"] = np.asarray(out["big"])
        arrays[f"transformed_{name}_small"] = np.asarray(out["small"])

    # A tuple of axes (device index a*4 + b, the minor axis reduced first), and one axis of a 2-D mesh.
    x = arrays["f32_in"]
    m24 = mesh((2, 4), ("a", "b"))
    out = jax.jit(
        jax.shard_map(
            lambda xl: jp.tree_psum(xl[0], ("a", "b")),
            mesh=m24,
            in_specs=P(("a", "b")),
            out_specs=P(),
        )
    )(x)
    arrays["tuple_ab"] = np.asarray(out)
    facts["tuple_ab_same_on_devices"] = same_on_devices(out)
    out = jax.jit(
        jax.shard_map(
            lambda xl: jp.tree_psum(xl[0], "b")[None],
            mesh=m24,
            in_specs=P(("a", "b")),
            out_specs=P("a"),
        )
    )(x)
    arrays["minor_b"] = np.asarray(out)  # [2, ...]: row a is the tree over summands a*4 .. a*4+3
    # A value not varying over the axis counts once per device (as with psum).
    out = jax.jit(
        jax.shard_map(
            lambda v: jp.tree_psum(v, "d"),
            mesh=mesh((4,), ("d",)),
            in_specs=P(),
            out_specs=P(),
        )
    )(x[3])
    arrays["invariant_D4"] = np.asarray(out)

    # The compiled all-reduce: data movement only.
    f = jax.jit(
        jax.shard_map(
            lambda xl: jp.tree_psum(xl, "d"),
            mesh=mesh((8,), ("d",)),
            in_specs=P("d"),
            out_specs=P(),
        )
    )
    facts["hlo_tree_psum"] = collectives_in(f.lower(jnp.ones((8, 1000), jnp.float32)).compile().as_text())
    f = jax.jit(
        jax.shard_map(
            lambda xl: jax.lax.psum(xl, "d"),
            mesh=mesh((8,), ("d",)),
            in_specs=P("d"),
            out_specs=P(),
        )
    )
    facts["hlo_psum"] = collectives_in(f.lower(jnp.ones((8, 1000), jnp.float32)).compile().as_text())

    # Errors, raised while tracing.
    def error_of(fn):
        try:
            fn()
        except Exception as err:  # noqa: BLE001 (the test asserts the type and message)
            return [type(err).__name__, str(err)]
        return None

    m3 = mesh((3,), ("d",))
    facts["error_axis_size_3"] = error_of(
        lambda: jax.jit(jax.shard_map(lambda v: jp.tree_psum(v, "d"), mesh=m3, in_specs=P("d"), out_specs=P()))(
            jnp.ones((3, 2))
        )
    )

    def loss(p, b, i):
        return jnp.sum(b * p)

    m8 = mesh((8,), ("d",))
    facts["error_leaves_below_devices"] = error_of(lambda: jp.value_and_grad(loss, mesh=m8, axis_name="d", leaves=4))
    facts["error_leaves_not_power_of_two"] = error_of(
        lambda: jp.value_and_grad(loss, mesh=m8, axis_name="d", leaves=12)
    )
    facts["error_devices_not_power_of_two"] = error_of(
        lambda: jp.value_and_grad(loss, mesh=m3, axis_name="d", leaves=8)
    )
    facts["error_unknown_axis"] = error_of(lambda: jp.value_and_grad(loss, mesh=m8, axis_name="x", leaves=8))
    facts["error_batch_not_multiple"] = error_of(
        lambda: jp.value_and_grad(loss, mesh=m8, axis_name="d", leaves=8)(jnp.ones(()), jnp.ones((60,)))
    )
    facts["error_tuple_axis_type"] = error_of(lambda: jp.tree_psum(jnp.ones(()), 3))

    # value_and_grad's aux (per leaf, in leaf order) and leaf index, and bitwise D invariance of a
    # loss with XLA reductions inside the leaf.
    def aux_loss(p, b, i):
        return jnp.sum(jnp.tanh(b * p)), (i, jnp.sum(b))

    batch = _summands(20, 64, (), np.float32)
    for d in (1, 2, 8):
        (lv, (idx, sums)), g = jp.value_and_grad(
            aux_loss, mesh=mesh((d,), ("d",)), axis_name="d", leaves=8, has_aux=True
        )(jnp.float32(0.5), batch)
        arrays[f"vg_loss_D{d}"], arrays[f"vg_grad_D{d}"] = np.asarray(lv), np.asarray(g)
        arrays[f"vg_aux_index_D{d}"], arrays[f"vg_aux_sum_D{d}"] = (
            np.asarray(idx),
            np.asarray(sums),
        )

    # .npz has no bfloat16: such arrays travel as their uint16 bits (the loader views them back).
    facts["bfloat16_keys"] = [k for k, v in arrays.items() if np.asarray(v).dtype == jnp.bfloat16]
    arrays = {
        k: np.asarray(v).view(np.uint16) if k in facts["bfloat16_keys"] else np.asarray(v) for k, v in arrays.items()
    }
    np.savez(os.path.join(out_dir, "collectives.npz"), **arrays)
    with open(os.path.join(out_dir, "collectives.json"), "w") as fh:
        json.dump(facts, fh)


def run_train(steps, ds):
    import jax

    from jaxdet._src.parallel import contracts as fp

    batches = fp.make_batches(steps, 64)
    result = {}
    for control in (False, True):
        for d in ds:
            m = jax.sharding.Mesh(np.array(jax.devices()[:d]), ("d",))
            hashes, same = fp.train(m, batches, control=control)
            result[f"{'psum' if control else 'tree'}{d}"] = {
                "hashes": hashes,
                "same_on_devices": all(same),
            }
    # The compiled train steps' collectives at the largest D.
    m = jax.sharding.Mesh(np.array(jax.devices()[: max(ds)]), ("d",))
    args = fp.example_step_args(m)
    for control in (False, True):
        text = fp.make_step(m, control=control).lower(*args).compile().as_text()
        result[f"hlo_{'psum' if control else 'tree'}"] = collectives_in(text)
    return result


def run_multi(process_id, num_processes, port, steps):
    """One process of a multi-controller run on its local devices: simulated CPU devices (gloo
    collectives), or the GPUs the caller left visible (NCCL across processes)."""
    import jax

    if os.environ.get("JAX_PLATFORMS") == "cpu":  # (asking JAX for its backend would start it too early)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=num_processes,
        process_id=process_id,
    )
    from jaxdet._src.parallel import contracts as fp

    m = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    hashes, same = fp.train(m, fp.make_batches(steps, 64))
    out = {
        "process": process_id,
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "hashes": hashes,
        "same_on_devices": all(same),
    }
    jax.distributed.shutdown()
    return out


def run_gpu(steps):
    """D=1 and D=2 on GPUs, the jaxdet step (tree) and the lax.psum step (the negative control); the
    caller compares the hashes across NCCL settings."""
    import jax

    from jaxdet._src.parallel import contracts as fp

    batches = fp.make_batches(steps, 64)
    result = {"nccl": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    for d in (1, 2):
        m = jax.sharding.Mesh(np.array(jax.devices("gpu")[:d]), ("d",))
        for name, control in (("tree", False), ("psum", True)):
            hashes, same = fp.train(m, batches, control=control)
            result[f"{name}{d}"] = {"hashes": hashes, "same_on_devices": all(same)}
    return result


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "collectives":
        run_collectives(args[0])
    elif mode == "train":
        print(json.dumps(run_train(int(args[0]), [int(a) for a in args[1:]] or [1, 2, 4, 8])))
    elif mode == "multi":
        print(json.dumps(run_multi(*map(int, args))))
    elif mode == "gpu":
        print(json.dumps(run_gpu(int(args[0]))))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
