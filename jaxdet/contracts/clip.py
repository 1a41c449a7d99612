"""Self-checks of global-norm clipping for the report (``jaxdet report``).

``report_checks()`` returns ``[(name, fn)]``; ``fn()`` returns ``(ok, detail)``, measured on the
current default device (docs/clipping.md states each contract; tests/test_clip.py proves it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet import _clip_reference as ref
from jaxdet import clip as _clip
from jaxdet.testing import same_bits as _same_bits


def _tree(seed=0, scale=3.0):
    rng = np.random.default_rng(seed)

    def r(shape, dtype):
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    return [r((), jnp.float32), r((0, 3), jnp.float32), r((3,), jnp.bfloat16), r((4096,), jnp.float32),
            r((5, 1000), jnp.float16), r((9000,), jnp.bfloat16), r((300, 1031), jnp.float32)]


def _device():
    return jax.devices()[0]


def _on_default(tree):
    return jax.device_put(tree, _device())


def check_norm_accuracy():
    tree = _tree(1, 1.0)
    got = float(_clip.global_norm(_on_default(tree)))
    want = math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in tree))
    rel = abs(got - want) / want
    return rel <= 1e-6, f"relative error {rel:.2e} vs float64 (limit 1e-6) on {_device().platform}"


def check_canonical_order():
    tree = _tree(2)
    clipped, norm = jax.jit(lambda t: _clip.clip_by_global_norm(t, 1.0))(_on_default(tree))
    want_leaves, want_norm = ref.clip_by_global_norm([np.asarray(x) for x in tree], 1.0)
    ok = _same_bits(norm, want_norm) and all(_same_bits(a, b) for a, b in zip(clipped, want_leaves))
    return ok, f"norm {float(norm):.9g} and {len(tree)} clipped leaves vs the NumPy canonical order: " + (
        "bitwise equal" if ok else "DIFFER")


def check_cpu_equals_device():
    dev = _device()
    if dev.platform == "cpu":
        return None, "the default device is the CPU: nothing to compare with (run on a GPU device)"
    tree = _tree(3)
    f = jax.jit(lambda t: _clip.clip_by_global_norm(t, 1.0))
    c_cpu, n_cpu = f(jax.device_put(tree, jax.devices("cpu")[0]))
    c_dev, n_dev = f(jax.device_put(tree, dev))
    ok = _same_bits(n_cpu, n_dev) and all(_same_bits(a, b) for a, b in zip(c_cpu, c_dev))
    return ok, f"CPU vs {dev.device_kind}: norm and clipped leaves " + ("bitwise equal" if ok else "DIFFER")


def check_run_to_run():
    tree = _on_default(_tree(4))
    f = jax.jit(lambda t: _clip.clip_by_global_norm(t, 1.0))
    first = f(tree)
    runs = [f(tree) for _ in range(3)]
    ok = all(_same_bits(r[1], first[1]) and all(_same_bits(a, b) for a, b in zip(r[0], first[0])) for r in runs)
    return ok, "4 runs bitwise identical" if ok else "runs DIFFER"


def check_identity_and_edge_cases():
    x = np.array([1.5, -0.0, 1e-40, np.uint32(0x7FA12345).view(np.float32)], np.float32)
    tree = _on_default([jnp.asarray(x), jnp.asarray(np.array([0.5, -0.0], np.float16))])
    c_inf, n_inf = _clip.clip_by_global_norm(tree, math.inf)  # NaN norm, max_norm=inf: untouched
    finite = _on_default([jnp.asarray(x[:3])])
    c_one, _ = _clip.clip_by_global_norm(finite, 10.0)  # scale 1
    zeros = _on_default([jnp.zeros((5,))])
    c_zero, n_zero = _clip.clip_by_global_norm(zeros, 0.0)  # 0/0 must not be NaN
    ok = (all(_same_bits(a, b) for a, b in zip(c_inf, tree)) and _same_bits(c_one[0], finite[0])
          and float(n_zero) == 0.0 and _same_bits(c_zero[0], zeros[0]) and math.isnan(float(n_inf)))
    return ok, ("scale 1 keeps bits (NaN payload, -0, subnormal); max_norm=0 with zero grads and "
                "max_norm=inf with NaN grads give no new NaN") if ok else "edge case FAILED"


def check_no_transfers_in_step():
    params = _on_default({"w": jnp.ones((64, 32)), "b": jnp.zeros((32,), jnp.bfloat16)})

    @jax.jit
    def step(p):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(p["w"] * 3.0)) + jnp.sum(p["b"].astype(jnp.float32) ** 2))(p)
        g, norm = _clip.clip_by_global_norm(g, 0.5)
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


def check_one_call_aliased():
    tree = _tree(5)
    text = jax.jit(lambda t: _clip.clip_by_global_norm(t, 1.0)).lower(tree).as_text()
    calls = text.count("jaxdet_clip_global_norm")
    aliases = text.count("output_operand_alias<")
    ok = calls == 1 and aliases == len(tree)
    return ok, f"{calls} native call for {len(tree)} leaves, {aliases} outputs aliased to their inputs"


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
