"""GPU: the CUDA GEMM kernels behind jaxdet_gemm / jaxdet_gemm_wgrad / jaxdet_gemm_wgrad_init, called
through the raw FFI targets (docs/matmul_cuda.md).

- accuracy against float64 (relative Frobenius norm) for every dtype x layout x output dtype;
- float32 is true float32, not TF32;
- row invariance: the bits of a row for M = 1 .. 4096 and at other positions among other rows;
- the weight gradient's chunk semantics (equal to chunk-by-chunk calls in order, trailing zero
  tokens, run to run, a donated accumulator, T = 0) and its form from nothing (`wgrad_init`);
- edge cases and the error for a misaligned K.

The tests run in this process with whichever kernels it selects: the default ones, or the sm_80
kernels when JAXDET_TESTING=gemm=sm80 is set. `test_sm80_kernels` runs this file again in a pytest
child process with JAXDET_TESTING=gemm=sm80 (read once per process), so `pytest -m gpu` covers both
kernel families on a Hopper GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdet  # noqa: F401  (registers the FFI targets)

SM80 = "gemm=sm80"


# ---- The raw FFI targets (the interface the Python API binds): jaxdet/_src/matmul/raw.py ----

from jaxdet._src.matmul.raw import gemm, wgrad, wgrad_init  # noqa: E402

# ---- Helpers ----


def family():
    """'sm80' when this process runs the sm_80 kernels (JAXDET_TESTING=gemm=sm80), else 'default'."""
    from jaxdet._src.core.switches import active_testing_overrides

    return "sm80" if active_testing_overrides().get("gemm") == "sm80" else "default"


def hopper_kernels():
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    return family() == "default" and cc.startswith("9.0")


def rand(key, shape, dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def relerr(out, ref):
    out = f64(out)
    if not np.all(np.isfinite(out)):
        return np.inf
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def ref_gemm(a, b, ta, tb):
    a, b = f64(a), f64(b)
    if ta:
        a = np.swapaxes(a, -1, -2)
    if tb:
        b = np.swapaxes(b, -1, -2)
    return np.matmul(a, b)


def row_bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
TOL = {"bf16": 1e-2, "f16": 2e-3, "f32": 1e-5}


# ---- Accuracy ----

ACCURACY = [
    (name, ta, tb, out_f32)
    for name in DTYPES
    for ta in (False, True)
    for tb in (False, True)
    for out_f32 in ((False, True) if name != "f32" else (False,))
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,ta,tb,out_f32",
    ACCURACY,
    ids=[f"{n}-ta{int(ta)}-tb{int(tb)}-out_{'f32' if o else n}" for n, ta, tb, o in ACCURACY],
)
def test_accuracy_against_float64(name, ta, tb, out_f32):
    dt = DTYPES[name]
    odt = jnp.float32 if out_f32 else dt
    # Output rounding bound: a float32 output is far tighter than a bf16/f16 one.
    tol = 1e-5 if (out_f32 or dt == jnp.float32) else TOL[name]
    key = jax.random.fold_in(jax.random.PRNGKey(1), ACCURACY.index((name, ta, tb, out_f32)))
    errors = {}
    for L, Lb, M, K, N in ((2, 2, 200, 264, 136), (3, 1, 72, 1032, 520), (1, 1, 1, 64, 4104)):
        if ta and M % 8 and dt != jnp.float32:
            continue  # transposed A needs M % 8 == 0 (its contiguous dimension)
        key, k1, k2 = jax.random.split(key, 3)
        a = rand(k1, (L, K, M) if ta else (L, M, K), dt)
        b = rand(k2, (Lb, N, K) if tb else (Lb, K, N), dt)
        out = jax.jit(lambda a, b: gemm(a, b, ta, tb, odt))(a, b)
        assert out.dtype == odt and out.shape == (L, M, N), (out.dtype, out.shape)
        errors[f"L={L} Lb={Lb} M={M} K={K} N={N}"] = relerr(out, ref_gemm(a, b, ta, tb))
    bad = {shape: e for shape, e in errors.items() if not e < tol}
    assert not bad, f"relative error above {tol:.0e}: {bad}"


@pytest.mark.gpu
def test_float32_is_not_tf32():
    # TF32 keeps 10 mantissa bits: products of inputs with low-order bits set lose them.
    k1, k2 = jax.random.split(jax.random.PRNGKey(7))
    a = jax.random.normal(k1, (1, 256, 512), jnp.float32)
    b = jax.random.normal(k2, (1, 512, 256), jnp.float32)
    e = relerr(gemm(a, b), ref_gemm(a, b, False, False))
    assert e < 1e-6, f"relerr {e:.2e} (TF32 would be ~3e-4)"


# ---- Row invariance ----

# across the M buckets' boundaries for N = 4096 on 132 SMs (65, 193, 257); the boundaries one by
# one are tests/test_gemm_buckets.py's
MS = (1, 3, 65, 193, 257, 4096)
ROW_CASES = {  # dtype, K, N, transpose_b, variant
    "bf16-K4096-N4096": (jnp.bfloat16, 4096, 4096, False, ""),
    "bf16-K4096-N4096-tb": (jnp.bfloat16, 4096, 4096, True, ""),
    "f16-K1024-N2048": (jnp.float16, 1024, 2048, False, ""),
    "f32-K1024-N512": (jnp.float32, 1024, 512, False, ""),
    "bf16-K1024-N512-out_f32": (jnp.bfloat16, 1024, 512, False, "f32out"),
    "bf16-K1032-N1000-ta": (jnp.bfloat16, 1032, 1000, False, "tadim"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_row_bits_do_not_depend_on_m_or_position(case):
    dt, K, N, tb, extra = ROW_CASES[case]
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(3), list(ROW_CASES).index(case)))
    big = rand(k1, (max(MS) + 7, K), dt)
    b = rand(k2, (N, K) if tb else (K, N), dt)
    odt = jnp.float32 if extra == "f32out" else dt
    ta = extra == "tadim"
    f = jax.jit(lambda a, b: gemm(a, b, ta, tb, odt))
    if ta:
        row = lambda a: f(a.T, b)  # (a stored [K, M]: its contiguous dimension is M)
    else:
        row = lambda a: f(a, b)
    ref = row_bits(row(big[: 8 if ta else 1])[0])
    diffs = {}
    for m in MS:
        if ta and m % 8:
            continue
        diffs[f"M={m}"] = int(np.sum(row_bits(row(big[:m])[0]) != ref))
    # The same row at other positions among other rows (and in a batch of 3 with a shared b).
    for pos in (5, 777, 4095):
        out = row(big[1:4097].at[pos].set(big[0]))
        diffs[f"pos={pos}"] = int(np.sum(row_bits(out[pos]) != ref))
    if not ta:
        a3 = jnp.stack([big[1:129], big[:128], big[2:130]])
        out3 = jax.jit(lambda a, b: gemm(a, b[None], False, tb, odt))(a3, b)
        diffs["batch L=3 (b broadcast)"] = int(np.sum(row_bits(out3[1, 0]) != ref))
    if case == "bf16-K4096-N4096":  # for the log (pytest -s): what jnp.dot does on the same rows
        j1, j2 = jnp.dot(big[:1], b)[0], jnp.dot(big[:4096], b)[0]
        print(f"jnp.dot row-0 elements changed, M=1 vs M=4096: {int(np.sum(row_bits(j1) != row_bits(j2)))}/{N}")
    assert all(v == 0 for v in diffs.values()), f"elements of the row whose bits changed: {diffs}"


# ---- The weight gradient ----

WGRAD_CASES = [
    (name, L, T, K, N, chunk)
    for name in DTYPES
    for L, T, K, N, chunk in ((1, 5000, 264, 520, 2048), (2, 300, 136, 72, 128), (1, 7, 64, 64, 2048))
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "name,L,T,K,N,chunk", WGRAD_CASES, ids=[f"{n}-L{L}-T{T}-K{K}-N{N}-chunk{c}" for n, L, T, K, N, c in WGRAD_CASES]
)
def test_wgrad_chunk_semantics(name, L, T, K, N, chunk):
    # Trailing zero tokens change nothing on the Hopper kernels (K tiles start at token 0 and TMA
    # zero-fills). CUTLASS 2.x (sm_80 path) takes the K residue first, so there the tile grouping
    # moves with the chunk length: still deterministic, but not padding-invariant.
    dt = DTYPES[name]
    key = jax.random.fold_in(jax.random.PRNGKey(5), WGRAD_CASES.index((name, L, T, K, N, chunk)))
    k0, k1, k2 = jax.random.split(key, 3)
    acc0 = jax.random.normal(k0, (L, K, N), jnp.float32)
    a = rand(k1, (L, T, K), dt)
    dc = rand(k2, (L, T, N), dt)
    f = jax.jit(lambda acc, a, dc: wgrad(acc, a, dc, chunk))
    out = f(acc0, a, dc)
    e = relerr(out, f64(acc0) + np.einsum("ltk,ltn->lkn", f64(a), f64(dc)))
    assert e < 1e-5, f"relerr {e:.2e}"
    # The same as chunk-by-chunk calls, in order (bitwise).
    seq = acc0
    g = jax.jit(lambda acc, a, dc: wgrad(acc, a, dc, 1 << 30))
    for t0 in range(0, T, chunk):
        seq = g(seq, a[:, t0 : t0 + chunk], dc[:, t0 : t0 + chunk])
    assert np.array_equal(row_bits(out), row_bits(seq)), "not the chunk-by-chunk sequence"
    assert np.array_equal(row_bits(out), row_bits(f(acc0, a, dc))), "differs run to run"
    # Trailing zero tokens inside the last chunk change nothing (Hopper kernels).
    pad = min((-T) % chunk, 37)
    if pad and hopper_kernels():
        ap = jnp.concatenate([a, jnp.zeros((L, pad, K), dt)], 1)
        dp = jnp.concatenate([dc, jnp.zeros((L, pad, N), dt)], 1)
        assert np.array_equal(row_bits(out), row_bits(f(acc0, ap, dp))), "trailing zero tokens changed bits"


@pytest.mark.gpu
def test_wgrad_donated_accumulator():
    # the aliasing XLA sets up for a donated accumulator under jit
    acc0 = jnp.ones((1, 64, 64), jnp.float32)
    a = rand(jax.random.PRNGKey(5), (1, 16, 64), jnp.bfloat16)
    fd = jax.jit(lambda acc, a: wgrad(acc, a, a, 8), donate_argnums=0)
    out = fd(acc0 + 0, a)
    e = relerr(out, 1.0 + np.einsum("ltk,ltn->lkn", f64(a), f64(a)))
    assert e < 1e-5, f"relerr {e:.2e}"


@pytest.mark.gpu
def test_wgrad_without_tokens_leaves_the_accumulator():
    acc0 = jax.random.normal(jax.random.PRNGKey(5), (1, 64, 64), jnp.float32)
    out = jax.jit(lambda acc, a: wgrad(acc, a, a))(acc0, jnp.zeros((1, 0, 64), jnp.bfloat16))
    assert np.array_equal(np.asarray(out), np.asarray(acc0))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "f16"])
@pytest.mark.parametrize("T", [100, 128, 300], ids=["one-chunk", "exactly-one-chunk", "several-chunks"])
def test_wgrad_init(name, T):
    # From nothing, in each result dtype: the float32 result is the chunk sequence into a zero
    # accumulator, and a half result is that float32 result cast once (Hopper: in the last chunk's
    # epilogue; sm_80: a cast kernel), bit for bit.
    dt = DTYPES[name]
    k1, k2 = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(6), T))
    a = rand(k1, (2, T, 136), dt)
    dc = rand(k2, (2, T, 72), dt)
    f32 = jax.jit(lambda a, dc: wgrad_init(a, dc, 128, jnp.float32))(a, dc)
    zero_acc = jax.jit(lambda a, dc: wgrad(jnp.zeros((2, 136, 72), jnp.float32), a, dc, 128))(a, dc)
    half = jax.jit(lambda a, dc: wgrad_init(a, dc, 128, dt))(a, dc)
    assert np.array_equal(np.asarray(f32), np.asarray(zero_acc)), "float32 result != the zero-accumulator sequence"
    assert np.array_equal(row_bits(half), row_bits(f32.astype(dt))), "half result != float32 result cast once"


# ---- Edge cases ----


@pytest.mark.gpu
def test_k0_gives_zeros():
    key = jax.random.PRNGKey(9)
    out = jax.jit(lambda a, b: gemm(a, b))(rand(key, (1, 4, 0), jnp.bfloat16), rand(key, (1, 0, 8), jnp.bfloat16))
    assert out.shape == (1, 4, 8) and np.all(np.asarray(out, np.float32) == 0)


@pytest.mark.gpu
def test_m0():
    key = jax.random.PRNGKey(9)
    out = jax.jit(lambda a, b: gemm(a, b))(rand(key, (1, 0, 16), jnp.bfloat16), rand(key, (1, 16, 8), jnp.bfloat16))
    assert out.shape == (1, 0, 8)


@pytest.mark.gpu
def test_misaligned_half_k_is_rejected_with_a_clear_error():
    key = jax.random.PRNGKey(9)
    a, b = rand(key, (1, 4, 12), jnp.bfloat16), rand(key, (1, 12, 8), jnp.bfloat16)
    with pytest.raises(Exception, match="multiple"):
        jax.jit(lambda a, b: gemm(a, b))(a, b).block_until_ready()


@pytest.mark.gpu
def test_float32_takes_odd_shapes():
    key = jax.random.PRNGKey(9)
    a, b = rand(key, (1, 5, 13), jnp.float32), rand(key, (1, 13, 7), jnp.float32)
    e = relerr(gemm(a, b), ref_gemm(a, b, False, False))
    assert e < 1e-6, f"relerr {e:.2e}"


# ---- The sm_80 kernels on a Hopper GPU ----


@pytest.mark.gpu
def test_sm80_kernels(request):
    """Every test above again, in a pytest child process with JAXDET_TESTING=gemm=sm80."""
    if family() == "sm80":
        pytest.skip("this process runs the sm_80 kernels already")
    config = request.config
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "--rootdir",
        str(config.rootpath),
    ]
    if config.inipath:
        argv += ["-c", str(config.inipath)]
    argv += [os.path.abspath(__file__), "-k", "not test_sm80_kernels"]
    env = dict(os.environ, JAXDET_TESTING=SM80, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    # Not from the checkout's root (rootdir and config are passed): there `python -m` would import the
    # source folder, which holds no compiled kernels, instead of the installed package.
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1200, cwd=tempfile.gettempdir())
    assert r.returncode == 0 and " passed" in r.stdout, r.stdout[-6000:] + r.stderr[-3000:]
