"""Self-checks of global-norm clipping for the report (``jaxdet report``).

``report_checks()`` returns ``[(name, fn)]``; ``fn()`` returns ``(ok, detail)``, measured on the
current default device (docs/clipping.md states each contract; tests/test_clip.py proves it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.clip import clip
from jaxdet._src.clip import reference as ref
from jaxdet._src.core.testing import same_bits as _same_bits


def mixed_tree(seed=0, scale=1.0):
    """Mixed dtypes and shapes: 0-d, empty, sub-chunk, exact chunk multiple, multi-chunk with tail."""
    rng = np.random.default_rng(seed)

    def r(shape, dtype):
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    return {
        "scalar": r((), jnp.float32),
        "empty": r((0, 7), jnp.float32),
        "small": r((3,), jnp.bfloat16),
        "chunk": r((4096,), jnp.float32),
        "tail": [r((5, 1000), jnp.float16), r((9000,), jnp.bfloat16)],
        "big": r((70, 1031), jnp.float32),
        "empty16": r((0,), jnp.float16),
    }


def _leaves_equal(a, b):
    return all(_same_bits(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _device():
    return jax.devices()[0]


def _on_default(tree):
    return jax.device_put(tree, _device())


def check_norm_accuracy(tree=None):
    """The norm is within 1e-6 (relative) of a float64 reference."""
    tree = mixed_tree(1) if tree is None else tree
    got = float(clip.global_norm(_on_default(tree)))
    want = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(tree)))
    rel = abs(got - want) / want
    return rel <= 1e-6, f"relative error {rel:.2e} vs float64 (limit 1e-6) on {_device().platform}"


def check_canonical_order(tree=None, max_norm=1.0):
    """Norm, global_norm and clipped leaves are bitwise the NumPy re-implementation of the order."""
    tree = mixed_tree(2, 3.0) if tree is None else tree
    clipped, norm = jax.jit(lambda t: clip.clip_by_global_norm(t, max_norm))(_on_default(tree))
    leaves = jax.tree.leaves(tree)
    want_leaves, want_norm = ref.clip_by_global_norm([np.asarray(x) for x in leaves], max_norm)
    ok = (
        _same_bits(norm, want_norm)
        and _same_bits(clip.global_norm(_on_default(tree)), want_norm)
        and all(_same_bits(a, b) for a, b in zip(jax.tree.leaves(clipped), want_leaves))
    )
    return ok, f"norm {float(norm):.9g} and {len(leaves)} clipped leaves vs the NumPy canonical order: " + (
        "bitwise equal" if ok else "DIFFER"
    )


def check_cpu_equals_device(tree=None, max_norm=1.0, nonfinite="propagate", device=None):
    """The CPU and the device (default: the default device) give the same norm and leaves."""
    dev = device or _device()
    if dev.platform == "cpu":
        return None, "the default device is the CPU: nothing to compare with (run on a GPU device)"
    tree = mixed_tree(3, 3.0) if tree is None else tree
    f = jax.jit(lambda t: clip.clip_by_global_norm(t, max_norm, nonfinite=nonfinite))
    c_cpu, n_cpu = f(jax.device_put(tree, jax.devices("cpu")[0]))
    c_dev, n_dev = f(jax.device_put(tree, dev))
    g_dev = clip.global_norm(jax.device_put(tree, dev))
    ok = _same_bits(n_cpu, n_dev) and _same_bits(g_dev, n_cpu) and _leaves_equal(c_cpu, c_dev)
    return ok, f"CPU vs {dev.device_kind}: norm and clipped leaves " + ("bitwise equal" if ok else "DIFFER")


def check_run_to_run(tree=None):
    tree = _on_default(mixed_tree(4, 5.0) if tree is None else tree)
    f = jax.jit(lambda t: clip.clip_by_global_norm(t, 1.0))
    first = f(tree)
    runs = [f(tree) for _ in range(3)]
    ok = all(_same_bits(r[1], first[1]) and _leaves_equal(r[0], first[0]) for r in runs)
    return ok, "4 runs bitwise identical" if ok else "runs DIFFER"


def check_identity_and_edge_cases():
    x = np.array([1.5, -0.0, 1e-40, np.uint32(0x7FA12345).view(np.float32)], np.float32)
    tree = _on_default([jnp.asarray(x), jnp.asarray(np.array([0.5, -0.0], np.float16))])
    c_inf, n_inf = clip.clip_by_global_norm(tree, math.inf)  # NaN norm, max_norm=inf: untouched
    finite = _on_default([jnp.asarray(x[:3])])
    c_one, _ = clip.clip_by_global_norm(finite, 10.0)  # scale 1
    zeros = _on_default([jnp.zeros((5,))])
    c_zero, n_zero = clip.clip_by_global_norm(zeros, 0.0)  # 0/0 must not be NaN
    ok = (
        all(_same_bits(a, b) for a, b in zip(c_inf, tree))
        and _same_bits(c_one[0], finite[0])
        and float(n_zero) == 0.0
        and _same_bits(c_zero[0], zeros[0])
        and math.isnan(float(n_inf))
    )
    return ok, (
        "scale 1 keeps bits (NaN payload, -0, subnormal); max_norm=0 with zero grads and "
        "max_norm=inf with NaN grads give no new NaN"
    ) if ok else "edge case FAILED"


def check_no_transfers_in_step():
    params = _on_default({"w": jnp.ones((64, 32)), "b": jnp.zeros((32,), jnp.bfloat16)})

    @jax.jit
    def step(p):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(p["w"] * 3.0)) + jnp.sum(p["b"].astype(jnp.float32) ** 2))(p)
        g, norm = clip.clip_by_global_norm(g, 0.5)
        return jax.tree.map(lambda a, b: a - 0.1 * b.astype(a.dtype), p, g), norm

    step(params)
    try:
        with jax.transfer_guard("disallow"):
            for _ in range(2):
                params, norm = step(params)
            jax.block_until_ready(norm)
    except Exception as e:  # noqa: BLE001 - the report shows what went wrong
        return False, f"transfer in the jitted step: {type(e).__name__}: {e}"
    return True, "jitted grad + clip + update runs under jax.transfer_guard('disallow')"


def check_one_call_aliased(tree=None):
    """A tree of at most 256 leaves is one native call whose outputs alias its inputs."""
    tree = mixed_tree(5) if tree is None else tree
    n = len(jax.tree.leaves(tree))
    text = jax.jit(lambda t: clip.clip_by_global_norm(t, 1.0)).lower(tree).as_text()
    calls = text.count("jaxdet_clip_global_norm")
    aliases = text.count("output_operand_alias<")
    norm_calls = jax.jit(clip.global_norm).lower(tree).as_text().count("jaxdet_global_norm")
    ok = calls == 1 and aliases == n and norm_calls == 1
    return ok, f"{calls} native call for {n} leaves, {aliases} outputs aliased to their inputs"


def report_checks():
    return [
        ("clip: norm within 1e-6 of a float64 reference", check_norm_accuracy),
        ("clip: bitwise equal to the documented canonical order", check_canonical_order),
        ("clip: CPU == default device, bitwise", check_cpu_equals_device),
        ("clip: run-to-run bitwise", check_run_to_run),
        ("clip: scale 1 keeps bits; 0/0 and max_norm=inf give no NaN", check_identity_and_edge_cases),
        ("clip: no host transfer in a jitted step", check_no_transfers_in_step),
        ("clip: one native call, outputs aliased", check_one_call_aliased),
    ]
