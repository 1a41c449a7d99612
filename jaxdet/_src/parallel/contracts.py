"""Self-check of device-count-invariant data parallelism for the main-job report (``python -m jaxdet``).

``report_checks()`` returns ``[(name, fn)]``; ``fn()`` returns ``(ok, detail)``. The check trains a
small model (jaxdet.matmul layers, dropout keyed by the global example index, clipping, optax adamw)
with ``jaxdet.parallel.value_and_grad`` on 1, 2, 4 and 8 devices and compares the SHA-256 of the
parameters and optimizer state after every step; a plain ``lax.psum`` step is the negative control.
It runs in a subprocess with 8 simulated CPU devices (the device count is fixed when JAX starts).
docs/parallel.md states the contract; tests/test_parallel.py proves it with 20 steps.

The model and the training loop live here so that the report, the tests (tests/parallel_worker.py)
and the benchmarks run the same program.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxdet
from jaxdet._src.parallel import parallel

RATE = 0.1
MAX_NORM = 1.0
LEAVES = 8


# ---- The model: x -> matmul -> tanh -> dropout -> matmul, squared error, one leaf at a time. ----


def init_params(features=16, hidden=64, outputs=8, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)  # host arrays: every process of a multi-process run has them
    return {
        "w1": (rng.standard_normal((features, hidden), np.float32) / np.sqrt(features)).astype(dtype),
        "b1": np.zeros((hidden,), dtype),
        "w2": (rng.standard_normal((hidden, outputs), np.float32) / np.sqrt(hidden)).astype(dtype),
    }


def make_batches(steps, batch_size, features=16, outputs=8, seed=1, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.standard_normal((batch_size, features), np.float32).astype(dtype),
            "y": rng.standard_normal((batch_size, outputs), np.float32).astype(dtype),
        }
        for _ in range(steps)
    ]


def leaf_loss(params, batch, leaf_index, key, scale):
    """The loss of one leaf (or of any contiguous block of examples starting at leaf `leaf_index`,
    whose size is that of this block): ``scale * sum((y_hat - y)^2)``."""
    n = batch["x"].shape[0]
    h = jnp.tanh(jaxdet.matmul(batch["x"], params["w1"]) + params["b1"])
    # The mask is that of the whole batch's [B, hidden] activations at these rows.
    h = jaxdet.dropout(h, key, RATE, offset=leaf_index * (n * h.shape[1]))
    err = jaxdet.matmul(h, params["w2"]) - batch["y"]
    return jnp.sum(err * err) * scale  # an XLA reduction over this leaf only


class _AdamW:
    """AdamW in plain jnp (elementwise, so its bits cannot depend on the device count), for the
    report where optax is not installed; the tests train with optax.adamw."""

    name = "AdamW (jnp)"

    def __init__(self, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4):
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, b1, b2, eps, weight_decay

    def init(self, params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return {"count": jnp.zeros((), jnp.int32), "mu": zeros, "nu": zeros}

    def update(self, grads, state, params):
        count = state["count"] + 1
        mu = jax.tree.map(lambda m, g: self.b1 * m + (1 - self.b1) * g, state["mu"], grads)
        nu = jax.tree.map(lambda v, g: self.b2 * v + (1 - self.b2) * g * g, state["nu"], grads)
        c1 = 1 - self.b1 ** count.astype(jnp.float32)
        c2 = 1 - self.b2 ** count.astype(jnp.float32)
        updates = jax.tree.map(
            lambda m, v, p: -self.lr * ((m / c1) / (jnp.sqrt(v / c2) + self.eps) + self.wd * p), mu, nu, params
        )
        return updates, {"count": count, "mu": mu, "nu": nu}


def _optimizer():
    """optax.adamw when optax is installed (the tests), else the same rule in plain jnp (the report
    in an environment without optax, such as the README's main job)."""
    try:
        import optax
    except ImportError:
        return _AdamW()
    opt = optax.adamw(1e-2)
    return opt


def _hash(tree):
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def _device_hashes(tree):
    """The hash of each addressable device's copy of a replicated tree, by device id."""
    leaves = jax.tree.leaves(tree)
    per_device = {}
    for x in leaves:
        for shard in x.addressable_shards:
            per_device.setdefault(shard.device.id, []).append(np.asarray(shard.data))
    return {d: _hash(arrs) for d, arrs in per_device.items()}


def make_step(mesh, axis_name="d", leaves=LEAVES, control=False):
    """One jitted train step ``(params, opt_state, batch, key) -> (params, opt_state, loss)``.

    control=False: ``jaxdet.parallel.value_and_grad``. control=True: the usual data-parallel step,
    each device's gradient over its whole shard, summed in float32 with ``lax.psum`` (the negative
    control; float32 like the tree, so that only the order differs).
    """
    opt = _optimizer()

    def step(params, opt_state, batch, key):
        scale = 1.0 / batch["x"].shape[0]  # the batch mean (exact scaling for a power-of-two batch)
        if control:
            loss, grads = _psum_value_and_grad(mesh, axis_name, scale)(params, batch, key)
        else:
            vg = parallel.value_and_grad(
                lambda p, b, i, k: leaf_loss(p, b, i, k, scale),
                mesh=mesh,
                axis_name=axis_name,
                leaves=leaves,
            )
            loss, grads = vg(params, batch, key)
        grads, _ = jaxdet.clip_by_global_norm(grads, MAX_NORM)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        return params, opt_state, loss

    return jax.jit(step)


def _psum_value_and_grad(mesh, axis_name, scale):
    def local(params, batch, key):
        params = lax.pcast(params, axis_name, to="varying")
        first = lax.axis_index(axis_name)  # this device's block, indexed like a leaf of its size
        loss, grads = jax.value_and_grad(leaf_loss)(params, batch, first, key, scale)
        loss, grads32 = lax.psum(
            (
                loss.astype(jnp.float32),
                jax.tree.map(lambda g: g.astype(jnp.float32), grads),
            ),
            axis_name,
        )
        return loss, jax.tree.map(lambda g, p: g.astype(p.dtype), grads32, params)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axis_name), P()), out_specs=P())


def train(mesh, batches, *, axis_name="d", leaves=LEAVES, control=False, seed=0):
    """Trains on `batches` (host arrays) and returns, per step, the hash of (params, opt_state)
    and whether every device of the mesh held the same bits."""
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P(axis_name))
    params = jax.device_put(init_params(seed=seed), replicated)
    opt_state = jax.device_put(_optimizer().init(params), replicated)
    step = make_step(mesh, axis_name, leaves, control)
    key = jaxdet.random.key(seed)
    hashes, same_on_devices = [], []
    for i, batch in enumerate(batches):
        batch = _global_batch(batch, sharded)
        step_key = np.asarray(jaxdet.random.fold_in(key, i))  # a host value, the same in every process
        params, opt_state, _ = step(params, opt_state, batch, step_key)
        per_device = _device_hashes((params, opt_state))
        hashes.append(next(iter(per_device.values())))
        same_on_devices.append(len(set(per_device.values())) == 1)
    return hashes, same_on_devices


def example_step_args(mesh, axis_name="d"):
    """Arguments of make_step's function, placed on `mesh` (to lower and inspect it)."""
    params = jax.device_put(init_params(), NamedSharding(mesh, P()))
    opt_state = jax.device_put(_optimizer().init(params), NamedSharding(mesh, P()))
    batch = _global_batch(make_batches(1, 64)[0], NamedSharding(mesh, P(axis_name)))
    return params, opt_state, batch, np.asarray(jaxdet.random.key(0))


def _global_batch(batch, sharding):
    """A global array from the same host data in every process (each process places its rows)."""
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda idx, x=x: x[idx]),
        batch,
    )


# ---- The report's check, in a subprocess with 8 simulated CPU devices. ----


CHECK_D = {False: (1, 2, 4, 8), True: (1, 8)}  # jaxdet.parallel; the lax.psum control


def _run_comparison(steps):
    devices = jax.devices()
    batches = make_batches(steps, 64)
    result = {}
    for control, ds in CHECK_D.items():
        for d in ds:
            mesh = jax.sharding.Mesh(np.array(devices[:d]), ("d",))
            hashes, same = train(mesh, batches, control=control)
            result[f"{'psum' if control else 'tree'}{d}"] = {
                "hashes": hashes,
                "same_on_devices": all(same),
            }
    return result


def subprocess_env(devices=8):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxdet.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def check_device_count_invariance(steps=2):
    # From the directory that holds the installed package: `python -m` puts the working directory
    # first on sys.path, and a source checkout's root would shadow the compiled package.
    root = os.path.dirname(os.path.dirname(os.path.abspath(jaxdet.__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdet._src.parallel.contracts", str(steps)],
        env=subprocess_env(),
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode:
        return False, f"subprocess failed: {proc.stderr.strip().splitlines()[-1:]}"
    optimizer = "optax.adamw" if not isinstance(_optimizer(), _AdamW) else _AdamW.name
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    tree = [r[f"tree{d}"] for d in CHECK_D[False]]
    psum = [r[f"psum{d}"] for d in CHECK_D[True]]
    same_d = all(t["hashes"] == tree[0]["hashes"] for t in tree)
    ranks = all(t["same_on_devices"] for t in tree)
    psum_distinct = len({p["hashes"][-1] for p in psum})
    ok = same_d and ranks
    return ok, (
        f"{steps} {optimizer} steps of a jaxdet model (CPU, 8 simulated devices), params+optimizer state SHA-256: "
        f"jaxdet.parallel D=1,2,4,8 {'identical' if same_d else 'DIFFER'}"
        f"{', every device equal' if ranks else ', devices DIFFER'}; "
        f"the same step with lax.psum: {psum_distinct} distinct results for D=1,8"
    )


def report_checks():
    return [
        (
            "parallel: bits independent of the device count",
            check_device_count_invariance,
        )
    ]


if __name__ == "__main__":
    print(json.dumps(_run_comparison(int(sys.argv[1]) if len(sys.argv) > 1 else 2)))
