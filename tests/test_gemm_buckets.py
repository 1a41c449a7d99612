"""GPU: the M-bucketed CUDA GEMM kernels (docs/matmul_cuda.md, "M buckets").

The forward and dA kernel sets hold several output tiles; the dispatcher picks one per call from
the shape (choose_tile in cuda/gemm/matmul_cuda.cu). The contract allows that only because every
tile of a set computes every output element with the same operations (same K tiles in the same
order, same MMA K depth, float32 accumulators, no split-K, same epilogue). These tests prove it:

- every tile against every other on the same inputs, forced with JAXDET_TESTING=gemm_tile
  (bfloat16/float16, forward and dA layouts, half and float32 outputs, NaN/Inf/subnormals/signed
  zeros, wide exponent ranges, exact cancellations, K not a multiple of the K tile, batches):
  `test_every_tile_computes_the_same_bits`;
- rows across every boundary the rule draws (M = b-1, b, b+1, at both ends of a batch):
  `test_rows_equal_across_every_bucket_boundary`;
- random M in [1, 20000]: `test_rows_equal_at_random_m`;
- the handlers are captured into XLA's command buffers (CUDA graphs) and give the same bits there:
  `test_handlers_run_in_command_buffers`.

Each runs for the Hopper kernels and for the sm_80 kernels (JAXDET_TESTING=gemm=sm80, read once
per process, hence subprocesses: this file is also the script they run).
"""

import json
import os
import subprocess
import sys

import command_buffers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdet
from jaxdet import _native
from jaxdet._src.matmul.matmul import GEMM_CHUNK, gemm_p
from jaxdet.testing import assert_bitwise_equal, bits, count_bit_differences

SCRIPT = os.path.abspath(__file__)
FAMILIES = {"default": "", "sm80": "gemm=sm80"}
HALF = {"bf16": jnp.bfloat16, "f16": jnp.float16}


def _gemm(a, b, transpose_b, out_dtype, chunk=GEMM_CHUNK):
    """The raw target: a [L, M, K] @ op(b) with b [Lb, K, N] or [Lb, N, K]; out [L, M, N]."""
    return gemm_p.bind(a, b, transpose_a=False, transpose_b=transpose_b, out_dtype=np.dtype(out_dtype), chunk=chunk)


def _subprocess(args, testing):
    """This file as a script, with JAXDET_TESTING = `testing` (no preallocation: several may share
    the GPU)."""
    env = dict(os.environ, JAXDET_TESTING=testing, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return subprocess.Popen(
        [sys.executable, SCRIPT, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc, timeout=900):
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


# ---- Inputs for the tile-against-tile comparison: the same in every process (seeded numpy). ----

# (L, Lb, M, K, N): one row and few rows, tile edges (64/65, 128/129), K not a multiple of 64 (and
# of 32, the sm_80 K tile), K below one K tile, N narrower than every tile and not a multiple of it,
# a batched b and a shared b with L > 1 (folded into rows).
SHAPES = [
    (1, 1, 1, 4104, 1000),
    (1, 1, 5, 72, 264),
    (1, 1, 64, 1000, 520),
    (1, 1, 65, 40, 136),
    (1, 1, 129, 8, 24),
    (1, 1, 300, 1000, 1000),
    (1, 1, 7, 8200, 256),
    (1, 1, 200, 4096, 4096),
    (3, 3, 17, 264, 136),
    (2, 1, 33, 520, 8),
]
KINDS = ("wide", "special", "cancel")
# K beyond one chunk, with small chunks (chunk, L, Lb, M, K, N): on Hopper the cooperative tiles run
# the chunks and their tree in one launch (split over CTAs when the tiles leave SMs idle, walked by
# each CTA otherwise: the 1536 x 3072 output with 128 x 256 tiles has more tiles than an H100 has
# SMs), the other tiles chunk by chunk; all must give the same bits. Chunk counts 2 to 17, short
# last chunks, a batched and a folded shared b.
CHUNK_SHAPES = [
    (256, 1, 1, 1, 4104, 1000),
    (256, 1, 1, 300, 1000, 1000),
    (128, 3, 3, 17, 264, 136),
    (128, 2, 1, 33, 520, 8),
    (256, 1, 1, 200, 4096, 1024),
    (128, 1, 1, 1536, 392, 3072),
]


def _values(rng, shape, kind, dtype):
    """A writable numpy array of `dtype` (rounded from float32 by numpy, RNE), of one of three kinds:
    wide     normals scaled by 2^e, e uniform over most of the dtype's range (every rounding inside
             a sum shows);
    special  NaN, +-Inf (sparse enough that most outputs stay finite), subnormals, +-0 and huge
             values among normals;
    cancel   normals; the caller makes the second half of the K axis cancel the first exactly."""
    half = dtype == jnp.float16
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "wide":
        lo, hi = (-12, 6) if half else (-40, 40)
        x *= np.exp2(rng.integers(lo, hi, shape)).astype(np.float32)
    elif kind == "special":
        u = rng.random(shape)
        rare = 0.2 / shape[-2 if shape[-2] > shape[-1] else -1]  # per element, over the K axis
        sub = np.float32(2.0**-20 if half else 2.0**-130)
        big = np.float32(3.0e4 if half else 1.0e30)
        cuts = np.cumsum([rare, rare, rare, 0.05, 0.02, 0.02, 0.01])
        x = np.where(u < cuts[0], np.nan, x)
        x = np.where((u >= cuts[0]) & (u < cuts[1]), np.inf, x)
        x = np.where((u >= cuts[1]) & (u < cuts[2]), -np.inf, x)
        x = np.where((u >= cuts[2]) & (u < cuts[3]), x * sub, x)
        x = np.where((u >= cuts[3]) & (u < cuts[4]), np.float32(0.0), x)
        x = np.where((u >= cuts[4]) & (u < cuts[5]), np.float32(-0.0), x)
        x = np.where((u >= cuts[5]) & (u < cuts[6]), np.clip(x * big, -6e4, 6e4) if half else x * big, x)
    with np.errstate(over="ignore"):
        return x.astype(np.dtype(dtype))


def tile_cases():
    """(name, a, b, transpose_b, out_dtype, chunk) for every shape (one chunk, then several),
    value kind, half dtype, layout (nn: the forward; nt: dA) and output dtype. The largest chunked
    output runs one kind and dtype (its outputs are most of the dumps' size)."""
    shapes = [(GEMM_CHUNK, *s) for s in SHAPES] + CHUNK_SHAPES
    for si, (chunk, L, Lb, M, K, N) in enumerate(shapes):
        for kind in KINDS:
            for dname, dtype in HALF.items():
                if M * N > 1 << 20 and (kind != "wide" or dname != "bf16"):
                    continue
                rng = np.random.default_rng([si, KINDS.index(kind), list(HALF).index(dname)])
                a = _values(rng, (L, M, K), kind, dtype)
                b = _values(rng, (Lb, K, N), kind, dtype)
                if kind == "cancel":
                    h = K // 2
                    a[..., h : 2 * h] = a[..., :h]
                    b[:, h : 2 * h, :] = -b[:, :h, :]
                for tb in (False, True):
                    bb = np.swapaxes(b, 1, 2).copy() if tb else b
                    for out in ("half", "f32"):
                        name = (
                            f"{dname} {'nt' if tb else 'nn'} out={out} {kind} L={L} Lb={Lb} M={M} K={K} N={N}"
                            f" chunk={chunk}"
                        )
                        yield name, a, bb, tb, dtype if out == "half" else jnp.float32, chunk


def dump_tile_outputs(path, tile):
    """The output bits of every case whose kernel set has `tile` (which JAXDET_TESTING forces), into
    `path`. (The Hopper sets have tiles that the sm_80 sets lack.)"""
    sets = kernel_tiles()
    outs = {}
    for name, a, b, tb, odt, chunk in tile_cases():
        if tile in sets[set_key(np.dtype(a.dtype).name, tb, odt == jnp.float32)]:
            outs[name] = bits(_gemm(jnp.asarray(a), jnp.asarray(b), tb, odt, chunk))
    np.savez(path, **outs)


def set_key(dname, tb, out_f32):
    """The family-independent name of a bucketed kernel set: dtype, layout, output dtype."""
    return f"{dname} {'nt' if tb else 'nn'} out_f32={out_f32}"


def kernel_tiles():
    """{set_key: tiles} of the bucketed kernel sets on this device and switch."""
    sets = {}
    for dname in ("bfloat16", "float16"):
        for tb in (False, True):
            for out_f32 in (False, True):
                sets[set_key(dname, tb, out_f32)] = [
                    f"{r}x{c}" for r, c in _native.gemm_cuda_tiles(dname, False, tb, out_f32)
                ]
    return sets


# ---- Rows across the bucket boundaries, and at random M. ----

BOUNDARY_K = 1000  # not a multiple of either K tile
BOUNDARY_NS = (512, 4096, 14336)  # boundaries depend on N (and on the SM count)
M_MAX = 20000


def _bucket_configs():
    for dname, dtype in (("bfloat16", jnp.bfloat16), ("float16", jnp.float16)):
        for tb in (False, True):
            for n in BOUNDARY_NS:
                yield dname, dtype, tb, False, n
    yield "bfloat16", jnp.bfloat16, False, True, 4096
    yield "bfloat16", jnp.bfloat16, True, True, 4096


def bucket_boundaries(dname, tb, out_f32, n, m_max=M_MAX):
    """Every M in [2, m_max] whose tile differs from M - 1's, as the dispatcher decides it."""
    tiles = [_native.gemm_cuda_tile(dname, False, tb, out_f32, m, n, 1) for m in range(1, m_max + 1)]
    return [m for m in range(2, m_max + 1) if tiles[m - 1] != tiles[m - 2]], tiles


def _operands(dtype, tb, n, rows, seed):
    rng = np.random.default_rng(seed)
    a = _values(rng, (1, rows, BOUNDARY_K), "wide", dtype)
    b = _values(rng, (1, BOUNDARY_K, n), "wide", dtype)
    return jnp.asarray(a), jnp.asarray(np.swapaxes(b, 1, 2).copy() if tb else b)


def check_bucket_boundaries():
    """For every boundary b the rule draws: the rows of batches of b-1, b and b+1 rows, taken from
    the start and from the end of a larger batch, have the bits of that batch's rows."""
    report = []
    for dname, dtype, tb, out_f32, n in _bucket_configs():
        bounds, tiles = bucket_boundaries(dname, tb, out_f32, n)
        if not bounds:  # one tile for every M (sm_80 at N = 14336): no boundary to cross
            report.append(f"{set_key(dname, tb, out_f32)} N={n}: one tile {tiles[0]}")
            continue
        rows = max(bounds) + 64
        a, b = _operands(dtype, tb, n, rows, seed=[n, tb, out_f32])
        odt = jnp.float32 if out_f32 else dtype
        ref = _gemm(a, b, tb, odt)
        for bnd in bounds:
            for m in (bnd - 1, bnd, bnd + 1):
                for start in (0, rows - m):
                    got = _gemm(a[:, start : start + m], b, tb, odt)
                    assert_bitwise_equal(
                        got,
                        ref[:, start : start + m],
                        f"{set_key(dname, tb, out_f32)} N={n} boundary {bnd} "
                        f"({tiles[bnd - 2]} | {tiles[bnd - 1]}): M={m} rows from {start}",
                    )
        report.append(
            f"{set_key(dname, tb, out_f32)} N={n}: boundaries "
            + ", ".join(
                f"{bnd} ({tiles[bnd - 2][0]}x{tiles[bnd - 2][1]} -> {tiles[bnd - 1][0]}x{tiles[bnd - 1][1]})"
                for bnd in bounds
            )
        )
    assert any("boundaries" in line for line in report), "the rule draws no boundary at any N: " + "; ".join(report)
    return report


def check_random_m(count=8, seed=2026):
    """Random M (`count` in [1, 20000] and `count` in [1, 300], where the buckets are): every row
    equals that row of the 20000-row batch, and row 0 equals row 0 computed alone (M = 1); with K
    in one chunk and in four (chunks of 256: on Hopper the chunks are split over CTAs or walked by
    each, as M decides)."""
    rng = np.random.default_rng(seed)
    ms = sorted(set(rng.integers(1, M_MAX + 1, count).tolist() + rng.integers(1, 301, count).tolist()))
    for dname, dtype, tb, out_f32, n in _bucket_configs():
        if dtype != jnp.bfloat16 or n != 4096:
            continue
        a, b = _operands(dtype, tb, n, M_MAX, seed=[7, tb, out_f32])
        odt = jnp.float32 if out_f32 else dtype
        for chunk in (GEMM_CHUNK, 256):
            ref = _gemm(a, b, tb, odt, chunk)
            one = _gemm(a[:, :1], b, tb, odt, chunk)
            where = f"{dname} tb={tb} out_f32={out_f32} chunk={chunk}"
            assert_bitwise_equal(one, ref[:, :1], f"{where} M=1")
            for m in ms:
                got = _gemm(a[:, :m], b, tb, odt, chunk)
                assert_bitwise_equal(got, ref[:, :m], f"{where} M={m}")
                assert_bitwise_equal(got[:, :1], one, f"{where} M={m}: row 0 vs M=1")
    return ms


# ---- Command buffers ----


def _chain(x, ws):
    for w in ws:
        x = jnp.tanh(jaxdet.matmul(x, w))
    return x


def _loss(x, ws):
    return jnp.sum(_chain(x, ws).astype(jnp.float32) ** 2)


def check_command_buffers():
    """jit(value_and_grad) of a chain of matmuls: the forward and dA (jaxdet_gemm) and dB
    (jaxdet_gemm_wgrad_init) custom calls, and matmul_weight_grad's jaxdet_gemm_wgrad, all run
    inside command buffers (XLA puts a custom call there only when its handler is marked
    compatible), three calls in a row (recorded, then replayed), with the bits of the same module
    without command buffers."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    ws = [jnp.asarray(rng.standard_normal((256, 256)) / 16, jnp.bfloat16) for _ in range(4)]
    dc = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    acc0 = jnp.zeros((256, 256), jnp.float32)

    def acc_steps(acc, x, dc):
        for _ in range(5):
            acc = jaxdet.matmul_weight_grad(x, dc, acc)
        return acc

    report = []
    xs = jnp.asarray(rng.standard_normal((4, 200, 1000)), jnp.bfloat16)  # K in four chunks of 256
    w = jnp.asarray(rng.standard_normal((1, 1000, 512)) / 32, jnp.bfloat16)

    def chunked(xs, w):
        return [_gemm(x[None], w, False, jnp.bfloat16, 256) for x in xs]

    cases = (
        (jax.value_and_grad(_loss, argnums=(0, 1)), (x, ws), ("jaxdet_gemm", "jaxdet_gemm_wgrad_init")),
        (acc_steps, (acc0, x, dc), ("jaxdet_gemm_wgrad",)),
        (chunked, (xs, w), ("jaxdet_gemm",)),
    )
    for fn, args, targets in cases:
        inside = command_buffers.check_in_command_buffers(fn, args, targets)
        report.append(f"{'/'.join(targets)}: {inside} custom calls in command buffers")
    return report


# ---- pytest (GPU) ----


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_tile_computes_the_same_bits(family, tmp_path):
    testing = FAMILIES[family]
    code, out = _finish(_subprocess(["--tiles"], testing))
    assert code == 0, out
    sets = json.loads(out.strip().splitlines()[-1])
    tiles = sorted({t for ts in sets.values() for t in ts}, key=lambda t: -int(t.split("x")[0]) * int(t.split("x")[1]))
    assert len(tiles) > 1, sets
    # one process per forced tile, all at once (outputs only; the comparison is here)
    procs = {
        t: _subprocess(["--dump", str(tmp_path / f"{t}.npz"), t], ",".join(filter(None, [testing, f"gemm_tile={t}"])))
        for t in tiles
    }
    for t, p in procs.items():
        code, out = _finish(p)
        assert code == 0, f"tile {t}: {out[-3000:]}"
    dumps = {t: np.load(tmp_path / f"{t}.npz") for t in tiles}
    failures = []
    for key, set_tiles in sets.items():
        ref = set_tiles[0]
        dname, layout, out_f32 = key.split()
        prefix = (
            f"{'bf16' if dname == 'bfloat16' else 'f16'} {layout} out={'f32' if out_f32.endswith('True') else 'half'} "
        )
        for name in dumps[ref].files:
            if not name.startswith(prefix):
                continue
            for t in set_tiles[1:]:
                n = count_bit_differences(dumps[t][name], dumps[ref][name])
                if n:
                    failures.append(f"{t} vs {ref}: {name}: {n} of {dumps[ref][name].size} elements differ")
    assert not failures, "\n".join(failures[:40])


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_equal_across_every_bucket_boundary(family):
    code, out = _finish(_subprocess(["--boundaries"], FAMILIES[family]))
    assert code == 0 and "BOUNDARIES OK" in out, out[-6000:]


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_equal_at_random_m(family):
    code, out = _finish(_subprocess(["--random-m"], FAMILIES[family]))
    assert code == 0 and "RANDOM M OK" in out, out[-6000:]


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_handlers_run_in_command_buffers(family):
    code, out = _finish(_subprocess(["--command-buffers"], FAMILIES[family]))
    assert code == 0 and "COMMAND BUFFERS OK" in out, out[-6000:]


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "--tiles":
        print(json.dumps(kernel_tiles()))
    elif mode == "--dump":
        dump_tile_outputs(sys.argv[2], sys.argv[3])
    elif mode == "--boundaries":
        print("\n".join(check_bucket_boundaries()))
        print("BOUNDARIES OK")
    elif mode == "--random-m":
        print("M:", check_random_m())
        print("RANDOM M OK")
    elif mode == "--command-buffers":
        print("in command buffers:", check_command_buffers())
        print("COMMAND BUFFERS OK")
    else:
        raise SystemExit(f"unknown mode {mode}")
