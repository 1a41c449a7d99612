"""Self-checks of softmax, log_softmax and cross-entropy for the report (``jaxdet report``) and the
tests.

``report_checks()`` returns ``[(name, fn)]``; ``fn()`` returns ``(ok, detail)``, measured on the
current default device (docs/softmax.md states each contract; tests/test_softmax.py calls these same
functions, with more shapes and dtypes, where they prove a contract).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import contract_checks
from jaxdet._src.core.contract_checks import default_device as _device
from jaxdet._src.core.testing import count_bit_differences, same_bits
from jaxdet._src.softmax import reference as ref
from jaxdet._src.softmax.softmax import (
    det_math,
    label_log_probs,
    log_softmax,
    softmax,
    softmax_cross_entropy_with_integer_labels,
)

MODES = ("softmax", "log_softmax", "cross_entropy")
ACCURACY = {np.dtype(jnp.float32): 4e-6, np.dtype(jnp.bfloat16): 8e-3, np.dtype(jnp.float16): 1e-3}
# Shapes: one short row, unaligned lengths, a row of several segments (8192 each) with a short tail.
SHAPES = ((1, 1), (5, 300), (9, 1027), (3, 8192 * 2 + 5))


def make_inputs(rows, n, dtype, seed=0, device=None, scale=3.0):
    """Logits [rows, n], labels [rows] (in range), a cotangent of the logits and one of the losses."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * scale).astype(np.float32)
    labels = rng.integers(0, n, rows).astype(np.int32)
    g = rng.standard_normal((rows, n)).astype(np.float32)
    gl = rng.standard_normal(rows).astype(np.float32)
    put = lambda a, dt: jax.device_put(jnp.asarray(a).astype(dt), device or _device())
    return put(x, dtype), put(labels, jnp.int32), put(g, dtype), put(gl, jnp.float32)


def _jnp_fns():
    """The usual jnp formulations, for the report's comparison only."""

    def xent(x, labels):
        logp = jax.nn.log_softmax(x.astype(jnp.float32))
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]

    return {"softmax": jax.nn.softmax, "log_softmax": jax.nn.log_softmax, "cross_entropy": xent}


def value_and_grad(mode, x, labels, g, gl, use_jnp=False):
    """(output, d input) of `mode` through jax.vjp, jitted; cross_entropy's output is per row."""
    fns = (
        _jnp_fns()
        if use_jnp
        else {
            "softmax": softmax,
            "log_softmax": log_softmax,
            "cross_entropy": softmax_cross_entropy_with_integer_labels,
        }
    )

    @jax.jit
    def f(x, labels, g, gl):
        if mode == "cross_entropy":
            out, vjp = jax.vjp(lambda x: fns[mode](x, labels), x)
            return out, vjp(gl)[0]
        out, vjp = jax.vjp(fns[mode], x)
        return out, vjp(g)[0]

    return f(x, labels, g, gl)


def reference(mode, x, labels, g, gl):
    dtype = np.asarray(x).dtype
    xs = np.asarray(x, np.float32)
    if mode == "cross_entropy":
        return (
            ref.cross_entropy(xs, np.asarray(labels)),
            ref.store(ref.cross_entropy_backward(xs, np.asarray(labels), np.asarray(gl)), dtype),
        )
    y = ref.softmax(xs) if mode == "softmax" else ref.log_softmax(xs)
    return ref.store(y, dtype), ref.store(ref.softmax_backward(xs, np.asarray(g, np.float32), mode), dtype)


def check_canonical_order(mode="cross_entropy", dtype=jnp.float32, shapes=SHAPES):
    """Outputs and input gradients bitwise equal to the NumPy re-implementation of the order."""
    bad = []
    for rows, n in shapes:
        args = make_inputs(rows, n, dtype, seed=rows + n)
        for name, a, e in zip(("out", "grad"), value_and_grad(mode, *args), reference(mode, *args)):
            if not same_bits(a, e):
                bad.append(f"{name}{[rows, n]}: {count_bit_differences(np.asarray(a), e)} differ")
    return contract_checks.bitwise_verdict(
        f"{mode} {np.dtype(dtype).name} at {len(shapes)} shapes (up to {max(s[1] for s in shapes)} "
        "classes) vs the NumPy order: ",
        bad,
    )


def math_inputs():
    """float32 inputs for exp/log/rsqrt: a stride through every bit pattern, plus special values."""
    bits = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32)
    special = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            1.0,
            -1.0,
            88.72283935546875,
            88.7228317,
            -103.97,
            -103.2,
            -104.0,
            -104.5,
            -111.9,
            -112.0,
            -112.5,
            -87.5,
            1e-45,
            1e-40,
            1.17549435e-38,
            3.4028235e38,
        ],
        np.float32,
    )
    return np.concatenate([bits.view(np.float32), special])


def check_math_functions():
    """det_math.h's exp, log and rsqrt on this device: bitwise equal to the NumPy re-implementation;
    exp_nonpositive (softmax's exp of x - M) bitwise equal to exp on every x <= 0 and NaN."""
    x = math_inputs()
    nonpositive = np.where(x > 0, -x, x)  # NaN stays NaN
    with np.errstate(all="ignore"):
        wants = {
            "exp": (x, ref.exp(x)),
            "log": (x, ref.log(x)),
            "rsqrt": (x, ref.canonical(np.float32(1) / np.sqrt(x))),
            "exp_nonpositive": (nonpositive, ref.exp(nonpositive)),
        }
    bad = []
    for op, (arg, want) in wants.items():
        got = det_math(jax.device_put(jnp.asarray(arg), _device()), op)
        if not same_bits(got, want):
            bad.append(f"{op}: {count_bit_differences(np.asarray(got), want)} differ")
    return contract_checks.bitwise_verdict(
        f"exp, log, rsqrt, exp_nonpositive of {x.size} float32 values on {_device().platform} vs NumPy: ",
        bad,
    )


def ulp_errors(x=None):
    """Max error in units in the last place of the float32 result: exp and log vs float64."""
    x = math_inputs() if x is None else x
    out = {}
    with np.errstate(all="ignore"):
        for op, f64 in (("exp", np.exp), ("log", np.log)):
            want = f64(x.astype(np.float64))
            keep = np.isfinite(want) & np.isfinite(want.astype(np.float32)) & np.isfinite(x)
            got = np.asarray(det_math(jnp.asarray(x[keep]), op), np.float64)
            ulp = np.spacing(np.abs(want[keep].astype(np.float32))).astype(np.float64)
            out[op] = float(np.max(np.abs(got - want[keep]) / ulp))
    return out


def check_row_invariance(mode="log_softmax", dtype=jnp.float32, n=4099, batches=(4, 16, 64)):
    """Row 0's output and gradient alone vs inside batches, at several positions, bitwise. The jnp
    formulation's differing elements are counted alongside (information, not part of the check)."""
    xb, lb, gb, glb = make_inputs(max(batches), n, dtype, seed=7)
    out1, dx1 = value_and_grad(mode, xb[:1], lb[:1], gb[:1], glb[:1])
    jout1, jdx1 = value_and_grad(mode, xb[:1], lb[:1], gb[:1], glb[:1], use_jnp=True)
    bad, jnp_worst = [], 0
    for batch in batches:
        for pos in sorted({0, batch // 2, batch - 1}):
            roll = lambda a: jnp.roll(a[:batch], pos, axis=0)  # row 0 lands at `pos`
            args = (roll(xb), roll(lb), roll(gb), roll(glb))
            out, dx = value_and_grad(mode, *args)
            if not (same_bits(out[pos : pos + 1], out1) and same_bits(dx[pos : pos + 1], dx1)):
                bad.append(f"batch {batch} position {pos}")
            jout, jdx = value_and_grad(mode, *args, use_jnp=True)
            jnp_worst = max(
                jnp_worst,
                count_bit_differences(jout[pos : pos + 1], jout1) + count_bit_differences(jdx[pos : pos + 1], jdx1),
            )
    ok = not bad
    size = n + (1 if mode == "cross_entropy" else n)
    return ok, (
        f"{mode} {np.dtype(dtype).name} n={n}: row alone vs in batches {list(batches)} (output and grad): "
        + ("bitwise equal" if ok else "DIFFER at " + ", ".join(bad))
        + f" (jnp: up to {jnp_worst}/{size} elements differ)"
    )


def _f64_reference(mode, x, labels, g, gl):
    x, g = np.asarray(x, np.float64), np.asarray(g, np.float64)
    z = x - x.max(1, keepdims=True)
    lse = np.log(np.exp(z).sum(1, keepdims=True))
    p = np.exp(z - lse)
    if mode == "softmax":
        return p, p * (g - (g * p).sum(1, keepdims=True))
    if mode == "log_softmax":
        return z - lse, g - p * g.sum(1, keepdims=True)
    rows = np.arange(x.shape[0])
    onehot = np.zeros_like(p)
    onehot[rows, np.asarray(labels)] = 1.0
    return (lse[:, 0] - z[rows, np.asarray(labels)]), np.asarray(gl, np.float64)[:, None] * (p - onehot)


def relative_errors(mode, dtype, rows=16, n=20000, seed=5):
    args = make_inputs(rows, n, dtype, seed=seed)
    return contract_checks.relative_errors(value_and_grad(mode, *args), _f64_reference(mode, *args))


def check_accuracy(mode="softmax", dtype=jnp.float32):
    errs = relative_errors(mode, dtype)
    bound = ACCURACY[np.dtype(dtype)]
    ok = max(errs) <= bound
    return ok, (
        f"{mode} {np.dtype(dtype).name} [16, 20000]: relative error vs float64: output {errs[0]:.1e}, "
        f"grad {errs[1]:.1e} (limit {bound:.0e})"
    )


def check_label_log_probs(dtype=jnp.float32, rows=12, n=20000):
    """label_log_probs == -cross_entropy == log_softmax at the label, bitwise."""
    x, labels, _, _ = make_inputs(rows, n, dtype, seed=17)
    lp = label_log_probs(x, labels)
    ce = softmax_cross_entropy_with_integer_labels(x, labels)
    at_label = jnp.take_along_axis(log_softmax(x), labels[:, None], axis=1)[:, 0]
    ok = same_bits(lp, -ce) and same_bits(lp, at_label)
    return ok, (
        "label_log_probs == -softmax_cross_entropy_with_integer_labels == log_softmax at the label: "
        + ("bitwise equal" if ok else "DIFFER")
    )


def check_losses_widen_exactly(dtype=jnp.bfloat16, rows=12, n=20000):
    """label_log_probs and cross-entropy of bfloat16/float16 logits have the bits of the same call
    on their float32 widening (the kernels widen before any arithmetic), value and the logits'
    gradient (the float32 call's gradient rounded once to the logits' dtype). The trainer relies on
    it to score logits as the model returns them (jaxdet/_src/sampling/trainer.py)."""
    x, labels, _, gl = make_inputs(rows, n, dtype, seed=23)
    wide = x.astype(jnp.float32)
    bad = []
    for name, f in (
        ("label_log_probs", label_log_probs),
        ("softmax_cross_entropy_with_integer_labels", softmax_cross_entropy_with_integer_labels),
    ):
        out, vjp = jax.vjp(lambda v, f=f: f(v, labels), x)
        out_wide, vjp_wide = jax.vjp(lambda v, f=f: f(v, labels), wide)
        if not same_bits(out, out_wide):
            bad.append(f"{name} value")
        if not same_bits(vjp(gl)[0], vjp_wide(gl)[0].astype(dtype)):
            bad.append(f"{name} gradient")
    return not bad, f"{np.dtype(dtype).name} logits [{rows}, {n}] vs their float32 widening: " + (
        "bitwise equal" if not bad else "DIFFER: " + ", ".join(bad)
    )


def check_cpu_equals_device(mode="cross_entropy", dtype=jnp.bfloat16, shapes=((3, 1027), (64, 4096), (5, 128256))):
    return contract_checks.cpu_equals_device(
        lambda *args: value_and_grad(mode, *args),
        lambda rows, n: make_inputs(rows, n, dtype, seed=11),
        f"{mode} {np.dtype(dtype).name}",
        ("out", "grad"),
        shapes,
    )


def check_cpu_equals_device_math():
    dev = _device()
    if dev.platform == "cpu":
        return None, contract_checks.ON_CPU
    x = jnp.asarray(math_inputs())
    cpu = jax.devices("cpu")[0]
    bad = [
        op
        for op in ("exp", "log", "rsqrt", "exp_nonpositive")
        if not same_bits(det_math(jax.device_put(x, cpu), op), det_math(jax.device_put(x, dev), op))
    ]
    ok = not bad
    return ok, f"exp, log, rsqrt, exp_nonpositive of {x.size} values: CPU vs {dev.device_kind} " + (
        "bitwise equal" if ok else "DIFFER: " + ", ".join(bad)
    )


def check_run_to_run(mode="cross_entropy", dtype=jnp.bfloat16, rows=64, n=32768, runs=4):
    args = make_inputs(rows, n, dtype, seed=13)
    ok = contract_checks.same_every_run(lambda: value_and_grad(mode, *args), runs)
    return ok, f"{mode} {np.dtype(dtype).name} [{rows}, {n}]: {runs} runs " + ("bitwise identical" if ok else "DIFFER")


def _all(check, **kw):
    return contract_checks.over_all(check, "mode", MODES, **kw)


def report_checks():
    return [
        ("softmax: exp/log/rsqrt bitwise equal to the NumPy re-implementation", check_math_functions),
        (
            "softmax: softmax/log_softmax/cross-entropy row invariance, forward and backward",
            lambda: _all(check_row_invariance),
        ),
        ("softmax: bitwise equal to the documented canonical order", lambda: _all(check_canonical_order)),
        ("softmax: label_log_probs == -cross-entropy == log_softmax at the label", check_label_log_probs),
        ("softmax: accuracy vs float64", lambda: _all(check_accuracy)),
        ("softmax: CPU == default device, bitwise (exp, log, rsqrt, exp_nonpositive)", check_cpu_equals_device_math),
        ("softmax: CPU == default device, bitwise", lambda: _all(check_cpu_equals_device)),
        ("softmax: run-to-run bitwise", lambda: _all(check_run_to_run)),
    ]
