"""jaxdet.parallel: the canonical tree, tree_psum, and training whose bits do not depend on the device count.

Every contract in docs/parallel.md names the test here that proves it. The device-count cases run in
a subprocess with 8 simulated CPU devices (tests/parallel_worker.py): the count is fixed when JAX
starts, and this process may already have started it with one device.
"""

import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from bitwise import assert_bitwise, bits

from jaxdet import parallel
from jaxdet._src.parallel.contracts import subprocess_env

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_worker.py")
STEPS = 20


def run_worker(*args, env=None):
    proc = subprocess.run(
        [sys.executable, WORKER, *map(str, args)],
        env=env or subprocess_env(8),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"worker {args} failed:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None


def reference_tree(xs):
    """docs/parallel.md's canonical tree in NumPy: neighbours paired level by level, lower index
    first, an odd last node carried up unchanged (its sibling is absent); adds in the dtype."""
    xs = [np.asarray(x) for x in xs]
    while len(xs) > 1:
        xs = [xs[i] + xs[i + 1] if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


@pytest.fixture(scope="module")
def collectives(tmp_path_factory):
    out = tmp_path_factory.mktemp("collectives")
    run_worker("collectives", out)
    facts = json.loads((out / "collectives.json").read_text())
    with np.load(out / "collectives.npz") as data:
        arrays = {k: v.view(ml_dtypes.bfloat16) if k in facts["bfloat16_keys"] else v for k, v in data.items()}
    return arrays, facts


@pytest.fixture(scope="module")
def training():
    return run_worker("train", STEPS)


# ---- tree_sum: the canonical tree on one device ----


def test_tree_sum_is_the_padded_tree():
    rng = np.random.default_rng(0)
    xs = [np.float32(v) for v in rng.standard_normal(9) * np.exp(rng.uniform(-20, 20, 9))]
    x = [jnp.float32(v) for v in xs]
    assert_bitwise(parallel.tree_sum(x[:3]), (x[0] + x[1]) + x[2])
    assert_bitwise(parallel.tree_sum(x[:5]), ((x[0] + x[1]) + (x[2] + x[3])) + x[4])
    assert_bitwise(parallel.tree_sum(x[:6]), ((x[0] + x[1]) + (x[2] + x[3])) + (x[4] + x[5]))
    assert_bitwise(
        parallel.tree_sum(x[:7]),
        ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + x[6]),
    )
    for n in range(1, 10):
        assert_bitwise(parallel.tree_sum(x[:n]), reference_tree(xs[:n]))
    # the order matters for these summands: the tree is not the left fold
    fold = xs[0]
    for v in xs[1:8]:
        fold = fold + v
    assert bits(fold) != bits(reference_tree(xs[:8]))
    # pytrees of the same structure, summed leaf by leaf
    trees = [{"a": x[i], "b": (x[i] * 2, x[8 - i])} for i in range(5)]
    out = parallel.tree_sum(trees)
    assert_bitwise(out["b"][1], reference_tree([xs[8 - i] for i in range(5)]))
    with pytest.raises(ValueError, match="at least one summand"):
        parallel.tree_sum([])


# ---- tree_psum across 1, 2, 4, 8 devices (8 simulated CPU devices) ----

CASES = ["f32", "f32_odd", "f32_small", "f32_scalar", "bf16", "f16"]


@pytest.mark.parametrize("case", CASES)
def test_tree_psum_is_the_tree_for_any_device_count(collectives, case):
    """Device d of D holds summands [d*8/D, (d+1)*8/D) and reduces them with tree_sum; tree_psum
    finishes the same tree: the result is the NumPy tree of all 8 for every D, on every device."""
    arrays, facts = collectives
    x = arrays[f"{case}_in"]
    want = reference_tree(list(x))
    for d in (1, 2, 4, 8):
        assert_bitwise(arrays[f"{case}_D{d}"], want, f"{case} D={d}")
        assert facts[f"{case}_D{d}_same_on_devices"], f"{case} D={d}: devices differ"
    # and the data was such that the order shows
    fold = x[0]
    for v in x[1:]:
        fold = fold + v
    if case not in {"f32_small", "f32_scalar"}:
        assert not np.array_equal(bits(fold), bits(want))


def test_tree_psum_pytree_of_mixed_dtypes(collectives):
    arrays, _ = collectives
    for k in ("a", "b", "c", "d"):
        want = reference_tree(list(arrays[f"pytree_{k}_in"]))
        for d in (1, 8):
            assert_bitwise(arrays[f"pytree_{k}_D{d}"], want, f"leaf {k} D={d}")
    assert arrays["pytree_b_D8"].dtype == ml_dtypes.bfloat16


def test_tree_psum_under_vmap_remat_and_scan(collectives):
    """jax.vmap, jax.checkpoint and lax.scan of tree_psum inside shard_map (a leaf that travels
    alone and a packed one): every slice has the plain call's bits."""
    arrays, _ = collectives
    for leaf in ("", "_small"):
        want = arrays[f"transformed_plain{leaf}"]
        for name in ("vmap", "remat", "scan"):
            assert_bitwise(arrays[f"transformed_{name}{leaf}"], want, f"{name}{leaf}")


def test_tree_psum_axis_tuple_and_one_axis_of_a_mesh(collectives):
    arrays, facts = collectives
    x = arrays["f32_in"]
    # ("a", "b") on a 2x4 mesh: device index a*4 + b, so the minor axis b is reduced first
    assert_bitwise(arrays["tuple_ab"], reference_tree(list(x)))
    assert facts["tuple_ab_same_on_devices"]
    # "b" alone: one tree per row a
    assert_bitwise(arrays["minor_b"][0], reference_tree(list(x[0:4])))
    assert_bitwise(arrays["minor_b"][1], reference_tree(list(x[4:8])))


def test_tree_psum_of_an_invariant_value_counts_every_device(collectives):
    arrays, _ = collectives
    x3 = arrays["f32_in"][3]
    assert_bitwise(arrays["invariant_D4"], reference_tree([x3] * 4))


def test_tree_psum_moves_data_only(collectives):
    _, facts = collectives
    assert facts["hlo_tree_psum"] == ["all-gather", "all-to-all"], facts["hlo_tree_psum"]
    assert "all-reduce" in facts["hlo_psum"]  # the detector sees psum's all-reduce


def test_errors(collectives):
    _, facts = collectives
    expected = {
        "error_axis_size_3": ("ValueError", "power of two, got 3"),
        "error_leaves_below_devices": (
            "ValueError",
            "leaves must be at least the size of mesh axis 'd' (8), got 4",
        ),
        "error_leaves_not_power_of_two": (
            "ValueError",
            "leaves must be a power of two, got 12",
        ),
        "error_devices_not_power_of_two": ("ValueError", "power of two, got 3"),
        "error_unknown_axis": ("ValueError", "'x' is not an axis of the mesh"),
        "error_batch_not_multiple": (
            "ValueError",
            "(60) must be a multiple of leaves (8)",
        ),
        "error_tuple_axis_type": ("TypeError", "axis_name must be a mesh axis name"),
    }
    for name, (kind, text) in expected.items():
        assert facts[name] is not None, f"{name}: no error raised"
        assert facts[name][0] == kind and text in facts[name][1], f"{name}: {facts[name]}"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))

    def loss(p, b, i):
        return jnp.sum(b * p)

    with pytest.raises(ValueError, match="leaves must be a power of two, got 3"):
        parallel.value_and_grad(loss, mesh=mesh, axis_name="d", leaves=3)
    with pytest.raises(TypeError, match="leaves must be an int"):
        parallel.value_and_grad(loss, mesh=mesh, axis_name="d", leaves=2.0)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        parallel.value_and_grad(loss, mesh=jax.devices(), axis_name="d", leaves=2)
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        parallel.value_and_grad(None, mesh=mesh, axis_name="d", leaves=2)


def test_value_and_grad_leaves_aux_and_index(collectives):
    """Each leaf sees its global index; aux comes back per leaf in leaf order; the loss (with an XLA
    reduction inside each leaf) and the gradient have the same bits for D = 1, 2, 8."""
    arrays, _ = collectives
    for d in (1, 2, 8):
        assert_bitwise(arrays[f"vg_aux_index_D{d}"], np.arange(8, dtype=np.int32))
        for what in ("loss", "grad", "aux_sum"):
            assert_bitwise(arrays[f"vg_{what}_D{d}"], arrays[f"vg_{what}_D1"], f"{what} D={d}")
    assert arrays["vg_aux_sum_D1"].shape == (8,)


EXPLICIT_MESH_SCRIPT = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType
from jaxdet import parallel

def loss(p, b, i):
    return jnp.sum(jnp.tanh(b @ p) * (i + 1).astype(jnp.float32))

rng = np.random.default_rng(0)
params = jnp.asarray(rng.standard_normal((5, 3), np.float32))
batch = jnp.asarray(rng.standard_normal((32, 5), np.float32))  # not placed on any mesh
out = {}
for d in (1, 2, 8):
    for kind in ("explicit", "auto"):
        mesh = jax.make_mesh((d,), ("d",), axis_types=(getattr(AxisType, kind.title()),), devices=jax.devices()[:d])
        lv, g = parallel.value_and_grad(loss, mesh=mesh, axis_name="d", leaves=8)(params, batch)
        out[f"{kind}{d}"] = [np.asarray(lv).tobytes().hex(), np.asarray(g).tobytes().hex()]
print(json.dumps(out))
"""


def test_value_and_grad_places_the_batch_on_an_explicit_mesh():
    """A mesh from jax.make_mesh with explicit axis types and a batch not placed on it: value_and_grad
    places the batch itself, with the bits of an Auto mesh, for D = 1, 2, 8."""
    proc = subprocess.run(
        [sys.executable, "-c", EXPLICIT_MESH_SCRIPT],
        env=subprocess_env(8),
        cwd=tempfile.gettempdir(),  # not the checkout's root, whose source folder would shadow the install
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for key, value in out.items():
        assert value == out["auto1"], key


def test_value_and_grad_explicit_mesh_one_device():
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices()[:1])
    f = parallel.value_and_grad(lambda p, b, i: jnp.sum(b * p), mesh=mesh, axis_name="d", leaves=2)
    loss, grads = f(jnp.ones((3,)), jnp.arange(12.0).reshape(4, 3))
    assert_bitwise(loss, np.float32(66.0))
    assert_bitwise(grads, np.array([18.0, 22.0, 26.0], np.float32))


@pytest.mark.parametrize("collective", ["psum", "pmean", "pmax", "all_gather"])
def test_value_and_grad_refuses_collectives_over_the_data_axis(collective):
    """A psum (pmean, ...) over the data axis inside loss_fn would count every leaf D times (or
    scale by D): value_and_grad refuses it, saying that it sums the leaves itself."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))

    def reduce(x):
        if collective == "all_gather":
            return jnp.sum(jax.lax.all_gather(x, "d"))
        return getattr(jax.lax, collective)(x, "d")

    def loss(p, b, i):
        return jax.lax.cond(i >= 0, reduce, lambda x: reduce(x) + 1.0, jnp.sum(b * p))  # inside a cond too

    f = parallel.value_and_grad(loss, mesh=mesh, axis_name="d", leaves=2)
    with pytest.raises(ValueError, match=r"over the data axis 'd'.*must not reduce over.*sums the leaves"):
        f(jnp.ones((3,)), jnp.ones((4, 3)))


# ---- Training: 20 adamw steps of a jaxdet model on 1, 2, 4, 8 devices ----


def test_training_bits_do_not_depend_on_device_count(training):
    """jaxdet.matmul layers, dropout keyed by the global element index, clip_by_global_norm and
    optax.adamw (jaxdet._src.parallel.contracts): the SHA-256 of the parameters and optimizer state after
    every step is the same for D = 1, 2, 4, 8 and on every device."""
    ref = training["tree1"]["hashes"]
    assert len(ref) == STEPS and len(set(ref)) == STEPS
    for d in (1, 2, 4, 8):
        assert training[f"tree{d}"]["hashes"] == ref, f"D={d}"
        assert training[f"tree{d}"]["same_on_devices"], f"D={d}: devices differ"
    assert "all-reduce" not in training["hlo_tree"] and "reduce-scatter" not in training["hlo_tree"]


def test_psum_step_changes_bits_with_device_count(training):
    """The negative control: the same step with lax.psum of per-device gradients (each device
    equal, but the result depends on D)."""
    finals = {d: training[f"psum{d}"]["hashes"][-1] for d in (1, 2, 4, 8)}
    assert all(training[f"psum{d}"]["same_on_devices"] for d in (1, 2, 4, 8))
    assert finals[1] != finals[2] and finals[1] != finals[8], finals
    assert len(set(finals.values())) >= 3, finals
    assert "all-reduce" in training["hlo_psum"]


# ---- GPU: D=1 vs D=2 under NCCL algorithm/protocol settings ----

# NCCL has Tree for all-reduce only (NCCL_ALGO=Tree alone makes its all-gathers fail), so Tree is
# asked per function (NCCL >= 2.24 syntax, as vLLM's and SGLang's deterministic modes set it).
NCCL_SWEEP = [
    {},
    {"NCCL_ALGO": "Ring"},
    {"NCCL_ALGO": "allreduce:tree"},
    {"NCCL_PROTO": "LL"},
    {"NCCL_PROTO": "Simple"},
    {"NCCL_ALGO": "Ring", "NCCL_PROTO": "LL"},
    {"NCCL_ALGO": "allreduce:tree", "NCCL_PROTO": "Simple"},
]


@pytest.mark.gpu
def test_gpu_device_count_and_nccl_settings_change_no_bit():
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")
    results = []
    for setting in NCCL_SWEEP:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
        env.update(setting, NCCL_NVLS_ENABLE="0")
        r = run_worker("gpu", 5, env=env)
        assert r["tree1"]["hashes"] == r["tree2"]["hashes"], f"D=1 vs D=2 under {setting}"
        assert r["tree2"]["same_on_devices"] and r["psum2"]["same_on_devices"]
        # the negative control: the plain psum step on the same GPUs changes bits with D
        assert r["psum1"]["hashes"][-1] != r["psum2"]["hashes"][-1], f"psum D=1 == D=2 under {setting}"
        results.append(r["tree2"]["hashes"])
    assert all(h == results[0] for h in results), "an NCCL setting changed the bits"
