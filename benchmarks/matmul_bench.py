"""Batch-invariant matmul vs jnp.dot on the GPU: forward, dA and dB, bfloat16, side by side in one run.

    python benchmarks/matmul_bench.py [--ms 1,2,4,...,16384] [--shapes all|4096x4096,...]
                                      [--ops fwd,dA,dB] [--reps 15] [--raw] [--out results.md]
                                      [--chunk-tokens 8192]
    python benchmarks/matmul_bench.py --tile-sweep all [--ms ...] [--ops fwd,dA]
    python benchmarks/matmul_bench.py --trace --ops dB --shapes 4096x4096 --ms 8
    python benchmarks/matmul_bench.py --sanitize          # every kernel family once, small (compute-sanitizer)
    python benchmarks/matmul_bench.py --shapes 256x256 --ms 1,8 --reps 2   # tiny (runs on the CPU)

--tile-sweep times jaxdet's forward and dA with every tile of the M-bucketed kernel sets forced
(JAXDET_TESTING=gemm_tile=..., one process per tile, one more for jnp.dot and the rule's own
choice): the data behind the bucket rule (docs/matmul_cuda.md). Other JAXDET_TESTING items in the
environment (gemm=sm80) are kept.

Uses `jaxdet.matmul` (forward and its VJP), or with --raw the raw FFI targets (jaxdet/_src/matmul/raw.py):
fwd = jaxdet_gemm(A, B); dA = jaxdet_gemm(dC, B, transpose_b=True);
dB = jaxdet_gemm_wgrad(acc=0 f32, A, dC, chunk_tokens=2048) (f32 result). The jnp baselines are
jnp.dot(A, B), jnp.dot(dC, B.T) and jnp.dot(A.T, dC) (bfloat16 out, what jax's gradient of jnp.dot
computes), or the VJP of jnp.dot when jaxdet.matmul is used.

--sanitize (for `compute-sanitizer --tool memcheck|racecheck`, tools/gpu_session.sh matmul): small
calls of every GEMM kernel family through the raw targets: edge tiles in every dimension (M, N, K
not multiples of the tiles), M <= 64 (one tile whose second consumer warpgroup holds no row),
batches, b broadcast, the chunked weight gradient (accumulating, and from nothing in every result
dtype), K beyond one chunk (split over CTAs and walked), and every tile of the M-bucketed kernel
sets (a row count for which the bucket rule picks it, with partial edge tiles). Prints the worst
relative error; the sanitizer reports memory errors.
Run it again with JAXDET_TESTING=gemm=sm80 for the sm_80 kernels.

Timing: one jitted program runs `--calls` products in sequence (each on its own copy of the
small operand, B rotating among copies when it is small enough that a repeated B would run from
L2; fewer calls where their outputs would not fit in a few GB), so the host's dispatch cost is paid
once per program, not per product: a product at M <= 16 takes 20-60 us on the GPU, less than one
dispatch. The time per product is the median over `--reps` timings of `--inner` back-to-back
programs (block_until_ready at the end) divided by the calls per program, the jnp and jaxdet
repetitions alternating (so that a clock or power drift during a long cell hits both sides alike).
A cell that fails (out of memory, a compile error) shows "OOM" or the exception's class and the
run goes on (_timing.guard); when the pair fails, each side is timed alone.
`--calls 1` times one product per dispatch, as a user's eager call would run. The "tile" column is the
output tile the bucket rule picked (forward and dA); "HBM" the fraction of the device's peak memory
bandwidth (--hbm-tbs, H100 SXM: 3.35 TB/s) that jaxdet reached moving the fewest bytes the product
needs (each operand read once, the result written once), for M <= 16. Row bits: how many elements
of output row 0 differ in any bit between M=1 and each other M (forward and dA; jnp.dot vs jaxdet),
the rows of one fixed batch of inputs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import failed, guard, header, pair_or_each  # noqa: E402

import jaxdet  # noqa: E402
import jaxdet._src.matmul.matmul as matmul_impl  # noqa: E402  (GEMM_CHUNK, read when a product is traced)
from jaxdet._src.core.switches import TESTING_ENV, parse_testing_overrides  # noqa: E402
from jaxdet._src.matmul.raw import gemm, wgrad, wgrad_init  # noqa: E402

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 128256)]
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 16384]


def parse():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ms", default=",".join(map(str, MS)), help="row counts M (comma-separated)")
    p.add_argument("--shapes", default="all", help="'all' or KxN,... (the weight's shape)")
    p.add_argument("--ops", default="fwd,dA,dB")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--calls", type=int, default=16, help="products per jitted program (at most)")
    p.add_argument("--raw", action="store_true", help="time the raw FFI targets instead of jaxdet.matmul")
    p.add_argument("--out", default="", help="also write the tables to this file")
    p.add_argument("--sanitize", action="store_true", help="every GEMM kernel family once, small, and exit")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=0,
        help="measure with this GEMM_CHUNK (= WGRAD_CHUNK_TOKENS) instead of the library's (an experiment: "
        "it changes the bits of every product with more than that many contracted elements, and dB's "
        "micro-batch granularity)",
    )
    p.add_argument("--hbm-tbs", type=float, default=3.35, help="peak HBM bandwidth, TB/s (H100 SXM: 3.35)")
    p.add_argument("--tile-sweep", default="", help="'all' or tiles (64x128,...): time every forced tile")
    p.add_argument("--sweep-child", default="", help=argparse.SUPPRESS)
    p.add_argument(
        "--trace",
        action="store_true",
        help="instead of timing, profile one program of each op, shape and M (jax.profiler): the kernels "
        "each side runs and the device's idle gaps",
    )
    return p.parse_args()


def timeit(fn, argsets, reps, inner, chain=False):
    """Median ms per call. chain: fn(state, *args) -> state (donated accumulators)."""
    if chain:
        state = argsets[0][0]
        for _ in range(2):
            state = fn(state, *argsets[0][1:])
        state.block_until_ready()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for i in range(inner):
                state = fn(state, *argsets[i % len(argsets)][1:])
            state.block_until_ready()
            times.append((time.perf_counter() - t0) / inner)
        return 1e3 * statistics.median(times)
    out = None
    for s in argsets:
        out = fn(*s)
    jax.block_until_ready(out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for i in range(inner):
            out = fn(*argsets[i % len(argsets)])
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return 1e3 * statistics.median(times)


def timeit_pair(fn_ref, fn_det, argsets, reps, inner):
    """Median ms per call of two functions on the same inputs, measured in alternating repetitions
    (and alternating which goes first), so that clock and power drifts during a long cell hit both
    alike."""
    fns = (fn_ref, fn_det)
    for fn in fns:
        out = None
        for s in argsets:
            out = fn(*s)
        jax.block_until_ready(out)
    times = ([], [])
    for rep in range(reps):
        for j in (0, 1) if rep % 2 == 0 else (1, 0):
            fn = fns[j]
            t0 = time.perf_counter()
            for i in range(inner):
                out = fn(*argsets[i % len(argsets)])
            jax.block_until_ready(out)
            times[j].append((time.perf_counter() - t0) / inner)
    return tuple(1e3 * statistics.median(t) for t in times)


def _tile_of(op, K, N, M):
    """The tile the bucket rule picks for the forward (GEMM N = N) or dA (GEMM N = K) of this cell."""
    from jaxdet import _native

    if op not in ("fwd", "dA") or not hasattr(_native, "gemm_cuda_tile"):
        return "-"
    r, c = _native.gemm_cuda_tile("bfloat16", False, op == "dA", False, M, N if op == "fwd" else K, 1)
    return f"{r}x{c}"


def _min_bytes(op, K, N, M):
    """Each operand read once and the result written once, bfloat16."""
    return 2.0 * (M * K + K * N + M * N)


def _functions(use_api):
    if use_api:
        fwd_det = jax.jit(jaxdet.matmul)
        da_det = jax.jit(lambda a, b, dc: jax.vjp(lambda x: jaxdet.matmul(x, b), a)[1](dc)[0])
        db_det = jax.jit(lambda a, b, dc: jax.vjp(lambda y: jaxdet.matmul(a, y), b)[1](dc)[0])
        da_ref = jax.jit(lambda a, b, dc: jax.vjp(lambda x: jnp.dot(x, b), a)[1](dc)[0])
        db_ref = jax.jit(lambda a, b, dc: jax.vjp(lambda y: jnp.dot(a, y), b)[1](dc)[0])
    else:
        fwd_det = jax.jit(lambda a, b: gemm(a, b))
        da_det = jax.jit(lambda a, b, dc: gemm(dc, b, transpose_b=True))
        db_det = jax.jit(lambda acc, a, dc: wgrad(acc, a, dc, 2048), donate_argnums=0)
        da_ref = jax.jit(lambda a, b, dc: jnp.dot(dc, b.T))
        db_ref = jax.jit(lambda a, b, dc: jnp.dot(a.T, dc))
    return {"fwd": (jax.jit(jnp.dot), fwd_det), "dA": (da_ref, da_det), "dB": (db_ref, db_det)}


def _inputs(key, K, N, ms, dt):
    """b [K, N] (and copies to rotate when small), and one batch of a / dC rows for every M."""
    key, kb, ka, kc = jax.random.split(key, 4)
    b = jax.random.normal(kb, (K, N), jnp.float32).astype(dt)
    nb = 3 if K * N * 2 < 200e6 else 1
    bs = [b] + [b + 0 for _ in range(nb - 1)]
    a_all = jax.random.normal(ka, (max(ms), K), jnp.float32).astype(dt)
    dc_all = jax.random.normal(kc, (max(ms), N), jnp.float32).astype(dt)
    return key, bs, a_all, dc_all


# What the copies of the small operands and the outputs of one program may take.
PROGRAM_BYTES = 4e9


def _sets(bs, a_all, dc_all, M, calls):
    """`calls` argument tuples (a, b, dc) for one program, no two alike (XLA would merge equal
    products): a and dc are copied per call, b rotates among the copies in bs. Fewer tuples when
    their operands and outputs would pass PROGRAM_BYTES."""
    nb = len(bs)
    K, N = bs[0].shape
    per_call = 2 * (2 * M * K + 2 * M * N + K * N)  # a, dc, and the largest output of fwd/dA/dB
    n = max(1, min(calls, int(PROGRAM_BYTES // per_call)))
    a, dc = a_all[:M] + 0, dc_all[:M] + 0
    return [(a + 0 if i else a, bs[i % nb], dc + 0 if i else dc) for i in range(n)]


def _program(fn):
    """One jitted program applying fn to every argument tuple of its list, in order."""
    return jax.jit(lambda argsets: [fn(*s) for s in argsets])


def time_products(fns, argsets, reps, inner):
    """Median ms per product of each function of fns (one, or a pair timed in alternating
    repetitions) on every tuple of argsets, the tuples run by one jitted program per function. A
    side that fails gives a Failed (_timing.guard); when the pair fails, each is timed alone."""
    programs = [_program(fn) for fn in fns]
    one = [(argsets,)]
    n = len(argsets)

    def time_one(program):
        return timeit(program, one, reps, inner) / n

    def time_pair(p_ref, p_det):
        return tuple(t / n for t in timeit_pair(p_ref, p_det, one, reps, inner))

    if len(programs) == 1:
        return (guard(time_one, programs[0]),)
    return pair_or_each(time_pair, time_one, *programs)


def sweep_child(args):
    """One process of --tile-sweep: JSON lines {op, K, N, M, ms, tile} for jnp (tile 'jnp') or for
    jaxdet with whatever JAXDET_TESTING forces; 'tiles': the bucketed set's tiles and the device."""
    if args.sweep_child == "tiles":
        from jaxdet import _native

        tiles = [f"{r}x{c}" for r, c in _native.gemm_cuda_tiles("bfloat16", False, False, False)]
        print(json.dumps({"tiles": tiles, "device": jax.devices()[0].device_kind}), flush=True)
        return
    ms = [int(x) for x in args.ms.split(",")]
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    fns = _functions(True)
    side = 0 if args.sweep_child == "jnp" else 1
    ops = args.ops.split(",")
    forced = parse_testing_overrides(os.environ.get(TESTING_ENV)).get("gemm_tile")
    if side == 1 and forced:
        from jaxdet import _native

        def has_forced(op):  # the forward sets have a tile the dA sets lack
            return forced in [f"{r}x{c}" for r, c in _native.gemm_cuda_tiles("bfloat16", False, op == "dA", False)]

        ops = [op for op in ops if op not in ("fwd", "dA") or has_forced(op)]
    key = jax.random.PRNGKey(0)
    for K, N in shapes:
        key, bs, a_all, dc_all = _inputs(key, K, N, ms, jnp.bfloat16)
        for M in ms:
            sets = _sets(bs, a_all, dc_all, M, args.calls)
            for op in ops:
                argsets = [(s[0], s[1]) for s in sets] if op == "fwd" else sets
                (t,) = time_products([fns[op][side]], argsets, args.reps, args.inner)
                tile = "jnp" if side == 0 else _tile_of(op, K, N, M)
                cell = {"error": str(t)} if failed(t) else {"ms": t}
                print(json.dumps({"op": op, "K": K, "N": N, "M": M, "tile": tile, **cell}), flush=True)
            del sets
        del bs, a_all, dc_all


def tile_sweep(args):
    """Runs the children (no JAX in this process: each child owns the GPU while it runs)."""
    base = [i for i in os.environ.get("JAXDET_TESTING", "").split(",") if i.strip() and not i.startswith("gemm_tile")]

    def child(name, forced):
        env = dict(os.environ, JAXDET_TESTING=",".join(base + ([f"gemm_tile={forced}"] if forced else [])))
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--sweep-child",
            name,
            "--ms",
            args.ms,
            "--shapes",
            args.shapes,
            "--ops",
            args.ops,
            "--reps",
            str(args.reps),
            "--inner",
            str(args.inner),
            "--calls",
            str(args.calls),
        ]
        r = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"sweep {name} {forced or ''}: rc={r.returncode}\n{r.stderr[-3000:]}", flush=True)
        return [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]

    info = child("tiles", None)[0]
    tiles = info["tiles"] if args.tile_sweep == "all" else args.tile_sweep.split(",")
    results = {}
    for name, forced in [("jnp", None), ("rule", None)] + [(t, t) for t in tiles]:
        for d in child("jnp" if name == "jnp" else "rule", forced):
            if "ms" in d:  # (a cell that failed in the child has "error" instead, and shows "-")
                results.setdefault((d["op"], d["K"], d["N"], d["M"]), {})[name] = d
        print(f"sweep {name}: done", flush=True)
    cols = ["jnp"] + tiles
    lines = [
        (
            f"# tile sweep ({info['device']}, {datetime.date.today()}, JAXDET_TESTING base "
            f"{','.join(base) or '-'}): ms per call (jnp.dot, then jaxdet with each tile forced)"
        ),
        "",
        "| op | K | N | M | " + " | ".join(cols) + " | rule's tile (ms) | best tile | rule / best | jnp / rule |",
        "|" + "---|" * (len(cols) + 8),
    ]
    for (op, K, N, M), r in results.items():
        best = min((t for t in tiles if t in r), key=lambda t: r[t]["ms"], default=None)
        rule = r.get("rule", {})
        rule_ms = rule.get("ms", float("nan"))
        best_ms = r[best]["ms"] if best else float("nan")
        jnp_ms = r.get("jnp", {}).get("ms", float("nan"))
        cells = [f"{r[c]['ms']:.4f}" if c in r else "-" for c in cols]
        lines.append(
            f"| {op} | {K} | {N} | {M} | "
            + " | ".join(cells)
            + f" | {rule.get('tile', '-')} ({rule_ms:.4f}) | {best} | {rule_ms / best_ms:.2f} | "
            f"{jnp_ms / rule_ms:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _relerr(out, ref):
    return np.linalg.norm(_f64(out) - ref) / np.linalg.norm(ref)


def _sanitize_wgrad(dt, kdim, seed):
    """The chunked weight gradient into an accumulator, and from nothing in every result dtype (one
    chunk, and several: the last chunk's epilogue reads the float32 workspace and writes the half
    result). dB has kdim rows. Returns the worst relative error against float64."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    acc = jax.random.normal(k1, (2, kdim, 264), jnp.float32)
    a = jax.random.normal(k2, (2, 300, kdim)).astype(dt)
    dc = jax.random.normal(k3, (2, 300, 264)).astype(dt)
    worst = _relerr(wgrad(acc, a, dc, 128), _f64(acc) + np.einsum("ltk,ltn->lkn", _f64(a), _f64(dc)))
    for out_dt in (dt, jnp.float32) if dt != jnp.float32 else (dt,):
        for T in (100, 300):
            r = wgrad_init(a[:, :T], dc[:, :T], 128, out_dt)
            worst = max(worst, _relerr(r, np.einsum("ltk,ltn->lkn", _f64(a[:, :T]), _f64(dc[:, :T]))))
    return worst


def _bucket_cases(native, dname, tb, n):
    """For every tile of the bucketed set: a row count (not a multiple of the tile's rows where the
    rule allows) for which the bucket rule picks that tile for n output columns."""
    tiles = [tuple(t) for t in native.gemm_cuda_tiles(dname, False, tb, False)]
    picked = {}
    for m in range(1, 4097):
        t = tuple(native.gemm_cuda_tile(dname, False, tb, False, m, n, 1))
        if t not in picked or picked[t] % t[0] == 0:
            picked[t] = m
    return [(t, picked[t]) for t in tiles if t in picked]


def sanitize():
    """Small calls of every GEMM kernel family through the raw targets (the module docstring's
    --sanitize), for compute-sanitizer."""
    from jaxdet import _native

    key = jax.random.PRNGKey(0)
    worst = 0.0
    for dt in (jnp.bfloat16, jnp.float16, jnp.float32):
        # every layout with M = 136 (two M tiles, the second partial), and M = 24 for the Hopper layouts
        # (b is shared, so the batch of 2 runs as one GEMM of 48 rows: one tile of <= 64 rows)
        cases = [(ta, tb, 136) for ta in (False, True) for tb in (False, True)]
        cases += [(False, False, 24), (False, True, 24)]
        for ta, tb, M in cases:
            for out in (dt, jnp.float32) if dt != jnp.float32 else (dt,):
                L, Lb, K, N = 2, 1, 200, 264
                key, k1, k2 = jax.random.split(key, 3)
                a = jax.random.normal(k1, (L, K, M) if ta else (L, M, K)).astype(dt)
                b = jax.random.normal(k2, (Lb, N, K) if tb else (Lb, K, N)).astype(dt)
                A = np.swapaxes(_f64(a), 1, 2) if ta else _f64(a)
                B = np.swapaxes(_f64(b), 1, 2) if tb else _f64(b)
                worst = max(worst, _relerr(gemm(a, b, ta, tb, out), A @ B))
        for kdim in (136, 40):  # dB's rows: two tiles, the second partial; and one tile of <= 64 rows
            worst = max(worst, _sanitize_wgrad(dt, kdim, seed=kdim))
    if hasattr(_native, "gemm_cuda_tiles"):
        covered = set()
        for dname, dt in (("bfloat16", jnp.bfloat16), ("float16", jnp.float16)):
            for tb, N in ((False, 4104), (True, 4104), (False, 14344), (True, 14344)):
                K = 200  # N = 4096 / 14336 + 8: a partial last column of every tile width
                for tile, M in _bucket_cases(_native, dname, tb, N):
                    key, k1, k2 = jax.random.split(key, 3)
                    a = jax.random.normal(k1, (1, M, K)).astype(dt)
                    b = jax.random.normal(k2, (1, N, K) if tb else (1, K, N)).astype(dt)
                    ref = _f64(a) @ (np.swapaxes(_f64(b), 1, 2) if tb else _f64(b))
                    for out in (dt, jnp.float32):  # (the float32-output sets lack 128x128: their own pick)
                        worst = max(worst, _relerr(gemm(a, b, False, tb, out), ref))
                    covered.add(f"{tile[0]}x{tile[1]}@M={M}")
        print("bucket tiles covered:", " ".join(sorted(covered)), flush=True)
    # K beyond one chunk (chunks of 128, the last short): on Hopper the cooperative tiles' chunk
    # scheduler, split over CTAs (few tiles) and walked by each CTA (1536 x 3072: more tiles than
    # SMs), and the narrow kernel's CTA per chunk (5 x 4104: 129 tiles of 16x32, 5 x 1000: 63 tiles
    # of 16x16); elsewhere chunk by chunk and the tree kernel.
    for dt in (jnp.bfloat16, jnp.float32):
        for tb in (False, True):
            for M, K, N in ((5, 600, 4104), (5, 600, 1000), (24, 600, 264), (300, 600, 1000), (1536, 392, 3072)):
                key, k1, k2 = jax.random.split(key, 3)
                a = jax.random.normal(k1, (1, M, K)).astype(dt)
                b = jax.random.normal(k2, (1, N, K) if tb else (1, K, N)).astype(dt)
                ref = _f64(a) @ (np.swapaxes(_f64(b), 1, 2) if tb else _f64(b))
                worst = max(worst, _relerr(gemm(a, b, False, tb, dt, chunk=128), ref))
    print(f"memcheck run done; worst relerr {worst:.2e}", flush=True)


def main():
    args = parse()
    if args.sanitize:
        return sanitize()
    if args.sweep_child:
        return sweep_child(args)
    if args.tile_sweep:
        return tile_sweep(args)
    ms = [int(x) for x in args.ms.split(",")]
    shapes = SHAPES if args.shapes == "all" else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ops = args.ops.split(",")
    use_api = not args.raw
    if args.chunk_tokens:
        if not isinstance(matmul_impl, types.ModuleType):  # (a function of that name would take the setting)
            raise SystemExit(f"--chunk-tokens: jaxdet._src.matmul.matmul is not the module ({matmul_impl!r})")
        # read when a product is traced, so set it before anything is jitted
        matmul_impl.GEMM_CHUNK = matmul_impl.WGRAD_CHUNK_TOKENS = args.chunk_tokens
    chunk_tokens = matmul_impl.GEMM_CHUNK if use_api else 2048
    dt = jnp.bfloat16
    head = (
        "# matmul benchmark: jaxdet vs jnp.dot, bfloat16\n\n"
        + header(
            f"jaxdet via {'jaxdet.matmul' if use_api else 'raw FFI targets'}; "
            f"dB chunk_tokens {chunk_tokens}; JAXDET_TESTING {os.environ.get('JAXDET_TESTING') or '-'}; "
            f"median of {args.reps} x {args.inner} back-to-back programs of up to {args.calls} products each, "
            "jnp and jaxdet repetitions alternating; "
            f"HBM fraction of {args.hbm_tbs} TB/s"
        )
        + "\n"
    )
    print(head, flush=True)
    rows = []
    bits = {}  # (op, K, N) -> {M: (jnp, jaxdet)} differing elements of row 0 vs M = 1
    key = jax.random.PRNGKey(0)
    fns = _functions(use_api)
    u = lambda x: np.asarray(x).view(np.uint16)

    if args.trace:
        from trace_summary import traced

        for K, N in shapes:
            key, bs, a_all, dc_all = _inputs(key, K, N, ms, dt)
            for M in ms:
                sets = _sets(bs, a_all, dc_all, M, args.calls)
                for op in ops:
                    argsets = [(s[0], s[1]) for s in sets] if op == "fwd" else sets
                    for side, fn in zip(("jnp", "jaxdet"), fns[op]):
                        print(f"\n#### trace: {op} K={K} N={N} M={M}, {side}, {len(argsets)} products\n", flush=True)
                        print(traced(_program(fn), (argsets,)), flush=True)
        return

    for K, N in shapes:
        inputs = guard(_inputs, key, K, N, ms, dt)
        if failed(inputs):
            print(f"K={K} N={N}: inputs {inputs}", flush=True)
            rows += [(op, K, N, M, inputs, inputs, inputs, inputs, inputs, "-", None) for M in ms for op in ops]
            continue
        key, bs, a_all, dc_all = inputs
        del inputs
        b = bs[0]

        def first_rows(b=b, a_all=a_all, dc_all=dc_all):
            refs = {"fwd": [u(f(a_all[:1], b)[0]) for f in fns["fwd"]]}
            if use_api:
                refs["dA"] = [u(f(a_all[:1], b, dc_all[:1])[0]) for f in fns["dA"]]
            return refs

        row0 = guard(first_rows)
        if failed(row0):
            print(f"K={K} N={N}: row 0 at M=1: {row0} (no row bits for this shape)", flush=True)
            row0 = {}
        for M in ms:
            sets = guard(_sets, bs, a_all, dc_all, M, args.calls)
            if failed(sets):
                print(f"K={K} N={N} M={M}: inputs {sets}", flush=True)
                rows += [(op, K, N, M, sets, sets, sets, sets, sets, "-", None) for op in ops]
                continue
            a, dc = sets[0][0], sets[0][2]
            for op, ref in row0.items():
                if op in ops:

                    def differing(op=op, ref=ref, a=a, b=b, dc=dc):
                        outs = [fns[op][i](a, b) if op == "fwd" else fns[op][i](a, b, dc) for i in (0, 1)]
                        return tuple(int(np.sum(u(o[0]) != r)) for o, r in zip(outs, ref))

                    diff = guard(differing)
                    if failed(diff):
                        print(f"{op} K={K} N={N} M={M}: row bits {diff}", flush=True)
                    else:
                        bits.setdefault((op, K, N), {})[M] = diff
            for op in ops:
                flops = 2.0 * M * K * N
                fn_ref, fn_det = fns[op]
                if op in {"fwd", "dA"} or use_api:
                    argsets = [(s[0], s[1]) for s in sets] if op == "fwd" else sets
                    t_ref, t_det = time_products([fn_ref, fn_det], argsets, args.reps, args.inner)
                else:
                    t_ref = guard(timeit, fn_ref, sets, args.reps, args.inner)
                    acc = jnp.zeros((K, N), jnp.float32)
                    chained = [(acc, s[0], s[2]) for s in sets]
                    t_det = guard(timeit, fn_det, chained, args.reps, args.inner, chain=True)
                hbm = _min_bytes(op, K, N, M) / (t_det * 1e-3) / (args.hbm_tbs * 1e12) if M <= 16 else None
                r = (
                    op,
                    K,
                    N,
                    M,
                    t_ref,
                    t_det,
                    t_ref / t_det,
                    flops / t_ref / 1e9,
                    flops / t_det / 1e9,
                    _tile_of(op, K, N, M),
                    hbm,
                )
                rows.append(r)
                print(
                    f"{op:3s} K={K:6d} N={N:6d} M={M:6d}  jnp {t_ref:9.4f} ms ({r[7]:6.0f} TF/s)  "
                    f"jaxdet {t_det:9.4f} ms ({r[8]:6.0f} TF/s)  ratio {r[6]:.3f}  tile {r[9]}"
                    + (f"  HBM {hbm:.2f}" if hbm is not None else ""),
                    flush=True,
                )
            del sets, a, dc
        del bs, b, a_all, dc_all

    lines = [
        head,
        (
            "| op | K | N | M | jnp.dot ms | jaxdet ms | throughput ratio (jnp time / jaxdet time) | "
            "jnp TFLOP/s | jaxdet TFLOP/s | tile | jaxdet HBM fraction |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        hbm = f"{r[10]:.2f}" if r[10] is not None else ""
        lines.append(
            f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.4f} | {r[5]:.4f} | {r[6]:.3f} | {r[7]:.0f} | "
            f"{r[8]:.0f} | {r[9]} | {hbm} |"
        )
    lines += [
        "",
        (
            "Row 0 bits (elements of output row 0 whose bits differ between M=1 and each other M; the most "
            "over all M, and at which M):"
        ),
        "",
        "| op | K | N | jnp.dot | jaxdet | M with jnp changes |",
        "|---|---|---|---|---|---|",
    ]
    for (op, K, N), per_m in bits.items():
        width = N if op == "fwd" else K
        jw = max(per_m.items(), key=lambda kv: kv[1][0])
        dw = max(per_m.items(), key=lambda kv: kv[1][1])
        changed = ",".join(str(m) for m, (j, _) in per_m.items() if j)
        lines.append(f"| {op} | {K} | {N} | {jw[1][0]}/{width} (M={jw[0]}) | {dw[1][1]}/{width} | {changed or '-'} |")
    text = "\n".join(lines) + "\n"
    print("\n" + text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
