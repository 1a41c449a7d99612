"""Self-checks of RMSNorm / LayerNorm for the report (``jaxdet report``) and the tests.

``report_checks()`` returns ``[(name, fn)]``; ``fn()`` returns ``(ok, detail)``, measured on the
current default device (docs/norm.md states each contract; tests/test_norm.py calls these same
functions, with more shapes and dtypes, where they prove a contract).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import contract_checks
from jaxdet._src.core.contract_checks import default_device as _device
from jaxdet._src.core.testing import count_bit_differences, same_bits
from jaxdet._src.norm import norm
from jaxdet._src.norm import reference as ref

KINDS = ("rms", "layer")
# Relative-norm bounds of y and dx against float64 (the storage rounding dominates for 16-bit).
ACCURACY = {np.dtype(jnp.float32): 4e-6, np.dtype(jnp.bfloat16): 8e-3, np.dtype(jnp.float16): 1e-3}


def make_inputs(tokens, n, dtype, seed=0, device=None):
    """x [tokens, n] of `dtype`, float32 scale and bias, and a cotangent g of x's dtype."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((tokens, n)) * 2.0 + 0.5).astype(np.float32)
    w = (1.0 + 0.5 * rng.standard_normal(n)).astype(np.float32)
    b = (0.3 * rng.standard_normal(n)).astype(np.float32)
    g = rng.standard_normal((tokens, n)).astype(np.float32)
    put = lambda a, dt: jax.device_put(jnp.asarray(a).astype(dt), device or _device())
    return put(x, dtype), put(w, jnp.float32), put(b, jnp.float32), put(g, dtype)


def apply(kind, x, w, b, eps=1e-5):
    return norm.rms_norm(x, w, eps) if kind == "rms" else norm.layer_norm(x, w, b, eps)


def apply_jnp(kind, x, w, b, eps=1e-5):
    """The usual jnp formulation (float32 statistics), for the report's comparison only."""
    xf = x.astype(jnp.float32)
    if kind == "rms":
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * w
    else:
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps) * w + b
    return y.astype(x.dtype)


def value_and_grads(kind, x, w, b, g, eps=1e-5, fn=None):
    """(y, dx, dscale, dbias) through jax.vjp, jitted (`fn`: apply, or apply_jnp)."""
    fn = fn or apply

    @jax.jit
    def f(x, w, b, g):
        y, vjp = jax.vjp(lambda x, w, b: fn(kind, x, w, b, eps), x, w, b)
        return (y,) + vjp(g)

    return f(x, w, b, g)


def reference(kind, x, w, b, g, eps=1e-5):
    """The NumPy canonical order: (y, dx, dscale, dbias) as the kernels must produce them."""
    dtype = np.asarray(x).dtype
    center = kind == "layer"
    xs, gs = np.asarray(x, np.float32), np.asarray(g, np.float32)
    y, mean, rstd = ref.norm_forward(xs, np.asarray(w), np.asarray(b) if center else None, eps, center)
    dx, terms = ref.norm_backward(xs, np.asarray(w), gs, mean, rstd, center)
    dw = ref.token_tree(terms)
    db = ref.token_tree(gs) if center else np.zeros_like(dw)
    return ref.store(y, dtype), ref.store(dx, dtype), dw, db


def check_canonical_order(kind="layer", dtype=jnp.bfloat16, shapes=((1, 1), (5, 300), (70, 1027), (33, 9000))):
    """y, dx, dscale and dbias bitwise equal to the NumPy re-implementation of the documented order."""
    bad = []
    for tokens, n in shapes:
        x, w, b, g = make_inputs(tokens, n, dtype, seed=tokens + n)
        got = value_and_grads(kind, x, w, b, g)
        want = reference(kind, x, w, b, g)
        for name, a, e in zip(("y", "dx", "dscale", "dbias"), got, want):
            if kind == "rms" and name == "dbias":
                continue
            if not same_bits(a, e):
                bad.append(f"{name}{[tokens, n]}: {count_bit_differences(np.asarray(a), e)} differ")
    return contract_checks.bitwise_verdict(
        f"{kind} {np.dtype(dtype).name} y, dx, dscale, dbias at {len(shapes)} shapes vs the NumPy order: ",
        bad,
    )


def check_row_invariance(kind="rms", dtype=jnp.bfloat16, n=4096, batches=(4, 16, 64)):
    """Row 0 (and its dx) alone vs inside batches, at several positions, bitwise. The jnp
    formulation's differing elements are counted alongside (information, not part of the check)."""
    xb, w, b, gb = make_inputs(max(batches), n, dtype, seed=7)
    y1, dx1 = value_and_grads(kind, xb[:1], w, b, gb[:1])[:2]
    jy1, jdx1 = value_and_grads(kind, xb[:1], w, b, gb[:1], fn=apply_jnp)[:2]
    bad, jnp_worst = [], 0
    for batch in batches:
        for pos in sorted({0, batch // 2, batch - 1}):
            # The batch's rows are rows 0 .. batch-1 of xb, rolled so that row 0 lands at `pos`.
            x, g = jnp.roll(xb[:batch], pos, axis=0), jnp.roll(gb[:batch], pos, axis=0)
            y, dx = value_and_grads(kind, x, w, b, g)[:2]
            if not (same_bits(y[pos : pos + 1], y1) and same_bits(dx[pos : pos + 1], dx1)):
                bad.append(f"batch {batch} position {pos}")
            jy, jdx = value_and_grads(kind, x, w, b, g, fn=apply_jnp)[:2]
            jnp_worst = max(
                jnp_worst,
                count_bit_differences(jy[pos : pos + 1], jy1) + count_bit_differences(jdx[pos : pos + 1], jdx1),
            )
    ok = not bad
    return ok, (
        f"{kind} {np.dtype(dtype).name} n={n}: row alone vs in batches {list(batches)} (y and dx): "
        + ("bitwise equal" if ok else "DIFFER at " + ", ".join(bad))
        + f" (jnp: up to {jnp_worst}/{2 * n} elements differ)"
    )


def check_param_grad_tree(kind="layer", tokens=128, n=96):
    """dscale/dbias over `tokens` tokens == the canonical tree over aligned power-of-two blocks'
    float32 gradients (what a device holding each block computes), for 2 ... tokens/8 blocks."""
    x, w, b, g = make_inputs(tokens, n, jnp.float32, seed=3)
    full = value_and_grads(kind, x, w, b, g)[2:]
    bad = []
    blocks = 2
    while blocks <= tokens // 8:
        size = tokens // blocks
        parts = [
            value_and_grads(kind, x[i * size : (i + 1) * size], w, b, g[i * size : (i + 1) * size])[2:]
            for i in range(blocks)
        ]
        for j, name in enumerate(("dscale", "dbias")):
            if kind == "rms" and name == "dbias":
                continue
            tree = ref.tree_fold([np.asarray(p[j]) for p in parts], lambda u, v: (u + v).astype(np.float32))
            if not same_bits(full[j], tree):
                bad.append(f"{name} with {blocks} blocks")
        blocks *= 2
    ok = not bad
    return ok, (
        f"{kind}: {tokens}-token dscale/dbias vs the tree over 2..{tokens // 8} aligned blocks: "
        + ("bitwise equal" if ok else "DIFFER: " + ", ".join(bad))
    )


def _f64_reference(kind, x, w, b, g, eps=1e-5):
    x, w, b, g = (np.asarray(a, np.float64) for a in (x, w, b, g))
    n = x.shape[1]
    mean = x.mean(1, keepdims=True) if kind == "layer" else 0.0
    d = x - mean
    rstd = 1.0 / np.sqrt((d * d).mean(1, keepdims=True) + eps)
    xhat = d * rstd
    y = xhat * w + (b if kind == "layer" else 0.0)
    gw = g * w
    t = gw - xhat * (gw * xhat).sum(1, keepdims=True) / n
    if kind == "layer":
        t = t - gw.sum(1, keepdims=True) / n
    return y, rstd * t, (g * xhat).sum(0), g.sum(0)


def relative_errors(kind, dtype, tokens=64, n=1000, seed=5):
    """Relative-norm errors of (y, dx, dscale, dbias) against a float64 reference."""
    x, w, b, g = make_inputs(tokens, n, dtype, seed=seed)
    return contract_checks.relative_errors(value_and_grads(kind, x, w, b, g), _f64_reference(kind, x, w, b, g))


def check_accuracy(kind="layer", dtype=jnp.float32):
    errs = relative_errors(kind, dtype)
    bound = ACCURACY[np.dtype(dtype)]
    ok = max(errs[:2]) <= bound and max(errs[2 : 3 if kind == "rms" else 4]) <= 1e-5
    return ok, (
        f"{kind} {np.dtype(dtype).name}: relative error vs float64 y {errs[0]:.1e}, dx {errs[1]:.1e} "
        f"(limit {bound:.0e}), dscale {errs[2]:.1e}"
        + (f", dbias {errs[3]:.1e}" if kind == "layer" else "")
        + " (limit 1e-05)"
    )


def check_cpu_equals_device(kind="layer", dtype=jnp.bfloat16, shapes=((3, 1027), (64, 4096), (40, 9000))):
    return contract_checks.cpu_equals_device(
        lambda *args: value_and_grads(kind, *args),
        lambda tokens, n: make_inputs(tokens, n, dtype, seed=11),
        f"{kind} {np.dtype(dtype).name}",
        ("y", "dx", "dscale", "dbias"),
        shapes,
    )


def check_run_to_run(kind="rms", dtype=jnp.bfloat16, tokens=256, n=4096, runs=4):
    args = make_inputs(tokens, n, dtype, seed=13)
    ok = contract_checks.same_every_run(lambda: value_and_grads(kind, *args), runs)
    verdict = "bitwise identical" if ok else "DIFFER"
    return ok, f"{kind} {np.dtype(dtype).name} [{tokens}, {n}]: {runs} runs {verdict}"


def report_checks():
    return [
        ("norm: rms_norm/layer_norm row invariance, forward and backward", lambda: _all(check_row_invariance)),
        ("norm: bitwise equal to the documented canonical order", lambda: _all(check_canonical_order)),
        ("norm: scale/bias gradients are the canonical tree over tokens", lambda: _all(check_param_grad_tree)),
        ("norm: accuracy vs float64", lambda: _all(check_accuracy)),
        ("norm: CPU == default device, bitwise", lambda: _all(check_cpu_equals_device)),
        ("norm: run-to-run bitwise", lambda: _all(check_run_to_run)),
    ]


def _all(check):
    return contract_checks.over_all(check, "kind", KINDS)
