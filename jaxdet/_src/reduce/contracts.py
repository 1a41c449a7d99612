"""Self-checks of jaxdet.sum / jaxdet.bias_add for the report (``jaxdet report``) and the tests.

``report_checks()`` returns ``[(name, fn)]``; ``fn()`` returns ``(ok, detail)``, measured on the
current default device (docs/reduce.md states each contract; tests/test_reduce.py calls these same
functions, with more shapes, dtypes and devices, where they prove a contract).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import contract_checks
from jaxdet._src.core.contract_checks import default_device as _device
from jaxdet._src.core.testing import count_bit_differences, same_bits
from jaxdet._src.core.tree import tree_sum
from jaxdet._src.matmul.matmul import matmul_weight_grad
from jaxdet._src.reduce import reduce
from jaxdet._src.reduce import reference as ref

C = reduce.CHUNK_TOKENS
DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))

# (shape, axis): K from 1 to beyond 3 chunks (where the tree is not the left fold), rows (B == 1),
# columns (B > 1), both, non-contiguous reduced axes, everything.
CASES = (
    ((3, 1, 5), 1),
    ((2, 300, 3), 1),
    ((4, 8193), 1),
    ((8193, 5), 0),
    ((2, 5 * C + 17, 3), 1),
    ((3, 4 * C), -1),
    ((6, 40, 7, 30), (0, 2)),
    ((2, 50, 3, 60), (1, 3)),
    ((5, 7, 9), None),
)


def make_input(shape, dtype, seed=0, device=None):
    """Values over several binades (so that a different order of adds changes bits), of `dtype`, on
    `device` (None: uncommitted, on the default device)."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray((rng.standard_normal(shape) * np.exp2(rng.integers(-6, 7, size=shape))).astype(np.float32))
    return x.astype(dtype) if device is None else jax.device_put(x.astype(dtype), device)


def _axes_of(axis, ndim):
    if axis is None:
        return tuple(range(ndim))
    return tuple(a % ndim for a in (axis if isinstance(axis, tuple) else (axis,)))


def check_reference(dtype=jnp.bfloat16, cases=CASES):
    """jaxdet.sum (to x's dtype and to float32) bitwise equal to the NumPy rule, and not equal to
    the left fold wherever K spans more than 3 chunks (so the check tells the orders apart)."""
    bad = []
    for i, (shape, axis) in enumerate(cases):
        x = make_input(shape, dtype, seed=i)
        axes = _axes_of(axis, len(shape))
        root = ref.canonical_sum(np.asarray(x), axes, np.float32)
        for out in {np.dtype(dtype), np.dtype(jnp.float32)}:
            got = reduce.sum(x, axis, dtype=out)
            want = ref.store(root, out)
            if not same_bits(got, want):
                bad.append(f"{list(shape)} axis={axis} -> {out.name}: {count_bit_differences(got, want)} differ")
            K = int(np.prod([shape[a] for a in axes]))
            if out == np.float32 and K > 3 * C and same_bits(got, ref.left_fold(np.asarray(x), axes, out)):
                bad.append(f"{list(shape)} axis={axis}: equals the left fold (the inputs cannot tell orders apart)")
    return contract_checks.bitwise_verdict(
        f"{np.dtype(dtype).name} at {len(cases)} shapes vs the NumPy rule: ", bad, separator="; "
    )


def check_independence(dtype=jnp.float32, K=C + 700):
    """An output's bits do not depend on the other outputs, the kept sizes, its position or the
    layout: columns of [K, 4] alone vs inside [K, 4 + n] at several offsets, rows of [3, K] inside
    more rows, and sum over axis 0 of x vs over axis 1 of x.T."""
    x = make_input((K, 4), dtype, seed=21)
    alone = reduce.sum(x, 0)
    bad = []
    for extra, offset in ((1, 0), (37, 21)):
        wide = make_input((K, 4 + extra), dtype, seed=22 + extra)
        wide = jnp.concatenate([wide[:, :offset], x, wide[:, offset:]], axis=1)
        if not same_bits(reduce.sum(wide, 0)[offset : offset + 4], alone):
            bad.append(f"columns inside {4 + extra} at {offset}")
    rows = x.T  # [4, K]
    if not same_bits(reduce.sum(rows, 1), alone):
        bad.append("rows (x.T, axis 1) vs columns (x, axis 0)")
    more = jnp.concatenate([make_input((7, K), dtype, seed=30), rows, make_input((50, K), dtype, seed=31)])
    if not same_bits(reduce.sum(more, 1)[7:11], alone):
        bad.append("rows inside 61 rows")
    batched = jnp.stack([make_input((K, 4), dtype, seed=32), x, make_input((K, 4), dtype, seed=33)])
    if not same_bits(reduce.sum(batched, 1)[1], alone):
        bad.append("a middle axis of [3, K, 4]")
    return contract_checks.bitwise_verdict(
        f"{np.dtype(dtype).name} K={K}: an output alone vs among others, in other layouts: ", bad
    )


def check_zero_padding(dtype=jnp.bfloat16, K=5000, padded=(C, C + 1, 3 * C + 5, 5 * C)):
    """Zeros appended to the reduced range (inside the last chunk, or adding chunks) change no bit."""
    x = make_input((3, K, 2), dtype, seed=40)
    base = reduce.sum(x, 1)
    bad = [str(n) for n in padded if not same_bits(reduce.sum(jnp.pad(x, ((0, 0), (0, n - K), (0, 0))), 1), base)]
    return contract_checks.bitwise_verdict(f"{np.dtype(dtype).name} K={K} padded with zeros to {list(padded)}: ", bad)


def check_pieces(dtype=jnp.float32, chunks=(4, 5, 8), tail=100):
    """Pieces of 2^j whole chunks (the last may be shorter), each reduced to float32 and combined by
    jaxdet.parallel.tree_sum, give the whole's float32 bits (and, cast, its dtype's)."""
    bad = []
    for n in chunks:
        K = n * C + tail
        x = make_input((2, K, 3), dtype, seed=50 + n)
        whole = reduce.sum(x, 1, dtype=jnp.float32)
        for per in (1, 2, 4):
            parts = [reduce.sum(x[:, k : k + per * C], 1, dtype=jnp.float32) for k in range(0, K, per * C)]
            if not same_bits(tree_sum(parts), whole):
                bad.append(f"{n} chunks + {tail} in pieces of {per}")
        if not same_bits(reduce.sum(x, 1), whole.astype(dtype)):
            bad.append(f"{n} chunks: the {np.dtype(dtype).name} result is not the float32 root cast once")
    return contract_checks.bitwise_verdict(f"{np.dtype(dtype).name}: pieces of 1, 2, 4 chunks vs the whole: ", bad)


def check_matmul_weight_grad(dtype=jnp.float32, tokens=(1, 8193, 5 * C + 17), n=6):
    """On the CPU, the sum over tokens of x [T, n] equals matmul_weight_grad(x, ones[T, 1]) (dB's
    chunk tree of an FMA fold of 1 * x), in float32 and cast once."""
    cpu = jax.devices("cpu")[0]
    bad = []
    for T in tokens:
        x = make_input((T, n), dtype, seed=60 + T, device=cpu)
        with jax.default_device(cpu):
            db = matmul_weight_grad(x, jnp.ones((T, 1), dtype)).reshape(n)
            if not same_bits(reduce.sum(x, 0, dtype=jnp.float32), db):
                bad.append(f"T={T} float32")
            if not same_bits(reduce.sum(x, 0), db.astype(dtype)):
                bad.append(f"T={T} {np.dtype(dtype).name}")
    return contract_checks.bitwise_verdict(
        f"{np.dtype(dtype).name}: sum over T in {list(tokens)} vs matmul_weight_grad(x, ones) on the CPU: ", bad
    )


# CPU == device: rows (B == 1), columns (B > 1), many chunks, odd sizes (unaligned rows).
DEVICE_CASES = (
    ((2048, 512), 1),
    ((4096, 384), 0),
    ((8, 16 * C + 3), 1),
    ((3, 9 * C, 5), 1),
    ((1027, 33), 0),
    ((33, 1027), 1),
    ((5, 2 * C + 1, 3), 1),
    ((4, 6, 8, 10), (0, 2)),
    ((3, 3 * C), None),
)


def check_cpu_equals_device(dtype=jnp.bfloat16, cases=DEVICE_CASES):
    """jaxdet.sum on the CPU and on the default device, to x's dtype and to float32, bitwise."""
    dev = _device()
    if dev.platform == "cpu":
        return None, contract_checks.ON_CPU
    cpu = jax.devices("cpu")[0]
    bad = []
    for i, (shape, axis) in enumerate(cases):
        x = make_input(shape, dtype, seed=70 + i)
        for out in {np.dtype(dtype), np.dtype(jnp.float32)}:
            on_dev = reduce.sum(x, axis, dtype=out)
            on_cpu = reduce.sum(jax.device_put(x, cpu), axis, dtype=out)
            if not same_bits(on_dev, on_cpu):
                bad.append(f"{list(shape)} axis={axis} -> {out.name}: {count_bit_differences(on_dev, on_cpu)} differ")
    return contract_checks.bitwise_verdict(
        f"{np.dtype(dtype).name}: CPU vs {dev.device_kind} at {len(cases)} shapes: ", bad, separator="; "
    )


def check_run_to_run(dtype=jnp.bfloat16, shape=(64, 3 * C + 5), runs=4):
    x = make_input(shape, dtype, seed=80)
    f = jax.jit(lambda x: (reduce.sum(x, 0), reduce.sum(x, 1, dtype=jnp.float32)))
    ok = contract_checks.same_every_run(lambda: f(x), runs)
    return ok, f"{np.dtype(dtype).name} {list(shape)} (both axes): {runs} runs " + (
        "bitwise identical" if ok else "DIFFER"
    )


def report_checks():
    return [
        ("reduce: jaxdet.sum bitwise equal to the documented rule", lambda: _all(check_reference)),
        ("reduce: an output's bits depend on its own elements only", check_independence),
        ("reduce: appended zeros change no bit", check_zero_padding),
        ("reduce: pieces of 2^j chunks combined by tree_sum give the whole", check_pieces),
        ("reduce: equals matmul_weight_grad(x, ones) on the CPU", check_matmul_weight_grad),
        ("reduce: CPU == default device, bitwise", lambda: _all(check_cpu_equals_device)),
        ("reduce: run-to-run bitwise", check_run_to_run),
    ]


def _all(check):
    return contract_checks.over_all(check, "dtype", DTYPES)
