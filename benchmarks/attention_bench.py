"""jaxdet.attention vs jax.nn.dot_product_attention (cudnn and xla), side by side in one run.

    python benchmarks/attention_bench.py             # the issue's shapes on the GPU
    python benchmarks/attention_bench.py --training-only --seqs 8192   # one training shape
    python benchmarks/attention_bench.py --tiny      # tiny shapes (runs on the CPU, proves the script)
    python benchmarks/attention_bench.py --sanitize  # every kernel once at small shapes (compute-sanitizer)
    python benchmarks/attention_bench.py --profile   # the training forward 3 times (ncu: gpu_session.sh ncu-attention)
    python benchmarks/attention_bench.py --trace-decode  # where the decode steps' time goes (jax.profiler)
    python benchmarks/attention_bench.py --decode-only   # the decode table only
    python benchmarks/attention_bench.py --decode-only --decode-caches 193 --decode-heads 16 8  # a sampler's steps

Training: batch 8, sequence 2048 and 8192, 32 query / 8 KV heads, head dim 128 (--head-dim), causal, bfloat16:
forward, and backward (the gradient of q, k and v; timed as forward + backward minus forward).
Decode: one query per sequence at position S - 1 against a KV cache of S positions, batch 1, 16,
64, S 4096 and 32768: time per step and the fraction of the HBM bandwidth that reading the cache
takes (bytes of K and V over time, over the device's peak bandwidth).

Prints markdown tables: median ms per call and ratio = baseline time / jaxdet time (> 1: jaxdet
is faster). The decode baseline is the fastest JAX implementation that runs. A cell whose
computation fails (XLA's score matrix out of memory at 8192 tokens, an implementation that does
not support the shape) shows "OOM" or the exception's class, and the run goes on (_timing.guard).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import failed, guard, header, timed  # noqa: E402

import jaxdet  # noqa: E402

# Peak HBM bandwidth (bytes/s) by device name, for the decode bandwidth fraction.
PEAK_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def rand(key, shape, dtype):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def implementations(on_gpu):
    return ("cudnn", "xla") if on_gpu else ("xla",)


def reference(impl):
    def f(q, k, v, kv_len=None):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=kv_len is None, key_value_seq_lengths=kv_len, implementation=impl
        )

    return f


def try_time(fn, *args, **kw):
    """Median seconds per call, or a Failed (OOM, a shape the implementation does not support)."""
    return guard(timed, fn, *args, **kw)


def fmt(x):
    if x is None or failed(x):
        return str(x if x is not None else "-")
    return f"{x * 1e3:.4f}" if x < 1e-4 else f"{x * 1e3:.3f}"  # below 0.1 ms: to 0.1 us


def ratio(base, mine):
    return "-" if base is None or mine is None or failed(base) or failed(mine) else f"{base / mine:.2f}"


def training(shapes, dtype, on_gpu, reps):
    print("## Training (causal), forward and backward\n")
    print(
        "| B | T | heads q/kv | D | pass | jaxdet ms | jaxdet TFLOP/s | "
        + " | ".join(f"{i} ms | ratio {i}" for i in implementations(on_gpu))
        + " |"
    )
    print("|---|---|---|---|---|---|---|" + "---|---|" * len(implementations(on_gpu)), flush=True)
    for B, T, N, K, D in shapes:
        qkv = guard(lambda: (rand(0, (B, T, N, D), dtype), rand(1, (B, T, K, D), dtype), rand(2, (B, T, K, D), dtype)))
        flops_fwd = 4 * B * N * T * T * D / 2  # causal: half the score matrix

        def fwd_bwd(f):
            def loss(q, k, v):
                return jnp.sum(f(q, k, v).astype(jnp.float32))

            return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

        def time_on_inputs(fn, qkv=qkv):
            return guard(lambda: timed(fn, *qkv, reps=reps)) if not failed(qkv) else qkv

        t_f = time_on_inputs(jax.jit(lambda q, k, v: jaxdet.attention(q, k, v)))
        t_fb = time_on_inputs(fwd_bwd(lambda q, k, v: jaxdet.attention(q, k, v)))
        base_f, base_b = [], []
        for impl in implementations(on_gpu):
            bf = time_on_inputs(jax.jit(reference(impl)))
            bfb = time_on_inputs(fwd_bwd(reference(impl)))
            base_f.append(bf)
            base_b.append(bfb if failed(bfb) else bfb - bf)  # a failed forward: its label
        t_b = t_fb if failed(t_fb) else t_fb - t_f
        for name, mine_t, base in (("fwd", t_f, base_f), ("bwd", t_b, base_b)):
            cells = " | ".join(f"{fmt(b)} | {ratio(b, mine_t)}" for b in base)
            flops = flops_fwd if name == "fwd" else 2.5 * flops_fwd
            tflops = "-" if failed(mine_t) else f"{flops / mine_t / 1e12:.1f}"
            print(f"| {B} | {T} | {N}/{K} | {D} | {name} | {fmt(mine_t)} | {tflops} | {cells} |", flush=True)
    print()


def decode_inputs(B, S, N, K, D, dtype):
    """One query per sequence at position S - 1 and a KV cache of S positions: q, k, v, q_positions,
    kv_lengths."""
    q = rand(0, (B, 1, N, D), dtype)
    kc, vc = rand(1, (B, S, K, D), dtype), rand(2, (B, S, K, D), dtype)
    return q, kc, vc, jnp.full((B, 1), S - 1, jnp.int32), jnp.full((B,), S, jnp.int32)


def jaxdet_step(q, k, v, p, n):
    return jaxdet.attention(q, k, v, q_positions=p, kv_lengths=n)


decode_step = jax.jit(jaxdet_step)

LOOP_STEPS = 32


def in_a_loop(step, graphs=False):
    """LOOP_STEPS dependent steps in one program (each step's output is the next step's query), as
    a jitted generation loop runs them: the time per step without Python's dispatch per call.

    XLA runs a sequence of at least 5 commands as a command buffer (CUDA graph), so a loop body of
    attention alone is a graph for XLA's five kernels and launched kernel by kernel for jaxdet's
    call and its two small fusions. `graphs`: compiled with command buffers from one command
    (``xla_gpu_graph_min_graph_size=1``), as a decode step with the rest of the model around the
    attention runs it."""

    def loop(q, *rest):
        return jax.lax.fori_loop(0, LOOP_STEPS, lambda i, x: step(x, *rest).astype(x.dtype), q)

    if not graphs:
        return jax.jit(loop)
    compiled = {}

    def run(*args):
        if "f" not in compiled:
            compiled["f"] = jax.jit(loop).lower(*args).compile(compiler_options={"xla_gpu_graph_min_graph_size": 1})
        return compiled["f"](*args)

    return run


def best_of(candidates, args, reps, per_call):
    """(seconds per step, implementation) of the fastest candidate that runs; (None, each
    candidate's failure) if none does."""
    best, best_impl, failures = None, "-", []
    for impl, fn in candidates:
        t = try_time(fn, *args, reps=reps)
        if failed(t):
            failures.append(f"{impl}: {t}")
            continue
        t = t / per_call
        if best is None or t < best:
            best, best_impl = t, impl
    return best, best_impl if best is not None else ", ".join(failures) or "-"


def decode(shapes, dtype, on_gpu, reps, peak):
    print("## Decode (one query per sequence against a KV cache)\n")
    print(
        "Per call: back-to-back jitted calls; in a loop: "
        f"{LOOP_STEPS} dependent steps in one jitted fori_loop (ms per step).\n"
    )
    print(
        "| B | cache | heads q/kv | D | jaxdet ms | HBM fraction | best JAX ms (impl) | ratio | "
        "jaxdet ms, in a loop | best JAX ms, in a loop (impl) | ratio, in a loop | "
        "jaxdet ms, loop as graphs | best JAX ms, loop as graphs (impl) | ratio, loop as graphs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, S, N, K, D in shapes:
        inputs = guard(decode_inputs, B, S, N, K, D, dtype)
        if failed(inputs):
            print(f"| {B} | {S} | {N}/{K} | {D} | inputs: {inputs} |" + " |" * 9, flush=True)
            continue
        q, kc, vc, pos, lens = inputs
        t = try_time(decode_step, q, kc, vc, pos, lens, reps=reps)
        best, best_impl = best_of(
            [(impl, jax.jit(reference(impl))) for impl in implementations(on_gpu)], (q, kc, vc, lens), reps, 1
        )
        t_loop = try_time(in_a_loop(jaxdet_step), q, kc, vc, pos, lens, reps=reps) / LOOP_STEPS
        best_loop, best_loop_impl = best_of(
            [(impl, in_a_loop(reference(impl))) for impl in implementations(on_gpu)],
            (q, kc, vc, lens),
            reps,
            LOOP_STEPS,
        )
        # (command buffers are a GPU compiler option: on the CPU the plain loop again)
        t_graph = try_time(in_a_loop(jaxdet_step, on_gpu), q, kc, vc, pos, lens, reps=reps) / LOOP_STEPS
        best_graph, best_graph_impl = best_of(
            [(impl, in_a_loop(reference(impl), on_gpu)) for impl in implementations(on_gpu)],
            (q, kc, vc, lens),
            reps,
            LOOP_STEPS,
        )
        bytes_read = 2 * B * S * K * D * jnp.dtype(dtype).itemsize
        loops = [x for x in (t_loop, t_graph) if not failed(x)]
        frac = f"{bytes_read / min(loops) / peak:.2f}" if peak and loops else "-"
        print(
            f"| {B} | {S} | {N}/{K} | {D} | {fmt(t)} | {frac} | {fmt(best)} ({best_impl}) | "
            f"{ratio(best, t)} | {fmt(t_loop)} | "
            f"{fmt(best_loop)} ({best_loop_impl}) | "
            f"{ratio(best_loop, t_loop)} | {fmt(t_graph)} | "
            f"{fmt(best_graph)} ({best_graph_impl}) | "
            f"{ratio(best_graph, t_graph)} |",
            flush=True,
        )
        del q, kc, vc, pos, lens, inputs
    print()


def trace_decode(shapes, dtype, on_gpu, calls=5):
    """Five back-to-back decode calls of jaxdet and of each JAX implementation under jax.profiler:
    the device's busy time against its span tells kernel time from launch and dispatch cost."""
    from trace_summary import traced

    for B, S, N, K, D in shapes:
        q, kc, vc, pos, lens = decode_inputs(B, S, N, K, D, dtype)
        runs = [("jaxdet", decode_step, (q, kc, vc, pos, lens))]
        runs += [(impl, jax.jit(reference(impl)), (q, kc, vc, lens)) for impl in implementations(on_gpu)]
        for graphs, how in ((False, "in a loop"), (True, "in a loop as graphs")):
            runs += [(f"jaxdet, {LOOP_STEPS} steps {how}", in_a_loop(jaxdet_step, graphs), (q, kc, vc, pos, lens))]
            runs += [
                (f"{impl}, {LOOP_STEPS} steps {how}", in_a_loop(reference(impl), graphs), (q, kc, vc, lens))
                for impl in implementations(on_gpu)
            ]
        for name, fn, fargs in runs:

            def repeated(*a, fn=fn):
                out = None
                for _ in range(calls):
                    out = fn(*a)
                return out

            summary = guard(traced, repeated, fargs)  # an implementation that does not support the shape
            print(f"\n#### trace: {name}, B {B}, cache {S}, {calls} calls\n\n{summary}")


def sanitize():
    """Each kernel once at small shapes: final and split forward, combine, delta, dQ, dK/dV, for
    every dtype and head dimension, with padding, packed segments (several passes per CTA) and
    non-finite inputs."""
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        for D in (64, 128, 256):
            q, k, v = rand(0, (2, 70, 4, D), dtype), rand(1, (2, 70, 2, D), dtype), rand(2, (2, 70, 2, D), dtype)
            seg = jnp.asarray(np.repeat([0, 1, 2], [30, 1, 39])[None].repeat(2, 0))
            loss = lambda q, k, v, **kw: jnp.sum(jaxdet.attention(q, k, v, **kw).astype(jnp.float32))  # noqa: E731
            jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v))
            jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(q, k, v, segment_ids=seg))
            jax.block_until_ready(
                jax.grad(loss, argnums=(0, 1, 2))(q, k, v, causal=False, kv_lengths=jnp.asarray([5, 70]))
            )
            # an inf in q, k, v and the output gradient: the tiles' cleaning (attention_nonfinite.cuh)
            qi, ki, vi = (x.at[0, 40, 1, 3].set(jnp.inf) for x in (q, k, v))
            w = jnp.ones(q.shape, jnp.float32).at[1, 20, 2, 5].set(-jnp.inf)
            weighted = lambda q, k, v: jnp.sum(jaxdet.attention(q, k, v).astype(jnp.float32) * w)  # noqa: E731
            jax.block_until_ready(jax.grad(weighted, argnums=(0, 1, 2))(qi, ki, vi))
            # decode against a cache longer than one split (split mode + combine on the GPU)
            kc, vc = rand(3, (2, 1100, 2, D), dtype), rand(4, (2, 1100, 2, D), dtype)
            jax.block_until_ready(
                jaxdet.attention(
                    q[:, :1], kc, vc, q_positions=jnp.asarray([[1000], [600]]), kv_lengths=jnp.asarray([1001, 1100])
                )
            )
            jax.block_until_ready(
                jaxdet.attention(
                    q[:, :1],
                    kc,
                    vc.at[0, 990, 1, 2].set(jnp.nan),
                    q_positions=jnp.asarray([[1000], [600]]),
                    kv_lengths=jnp.asarray([1001, 1100]),
                )
            )
            # decode batches within one split (split mode, one split a row): a grid of a few CTAs
            # (DecodeSplitKernel at D = 128) and one of more CTAs than an H100 has SMs (one warp each)
            for b in (2, 40):
                qd, kd, vd = (
                    rand(10, (b, 1, 8, D), dtype),
                    rand(11, (b, 300, 4, D), dtype),
                    rand(12, (b, 300, 4, D), dtype),
                )
                pos = jnp.full((b, 1), 250)
                jax.block_until_ready(jaxdet.attention(qd, kd, vd, q_positions=pos, kv_lengths=pos[:, 0] + 1))
            # a decode step past 64 splits: CombineKernel's rounds (D splits) and loads (64 at a time)
            kl, vl = rand(8, (1, 34000, 1, D), dtype), rand(9, (1, 34000, 1, D), dtype)
            pos = jnp.asarray([[33000]])
            jax.block_until_ready(jaxdet.attention(q[:1, :1, :1], kl, vl, q_positions=pos, kv_lengths=pos[0] + 1))
            # packed sequences past one split in split mode: a CTA's rows in several passes
            q6, k6, v6 = rand(5, (1, 600, 1, D), dtype), rand(6, (1, 600, 1, D), dtype), rand(7, (1, 600, 1, D), dtype)
            seg6 = jnp.asarray(np.repeat([0, 1, 2], [150, 449, 1])[None])
            jax.block_until_ready(jaxdet.attention(q6, k6, v6, segment_ids=seg6))
    print("sanitize: every attention kernel ran")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (runs on the CPU)")
    parser.add_argument("--sanitize", action="store_true", help="each kernel once at small shapes")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--head-dim", type=int, default=128, help="the training and decode shapes' head dimension")
    parser.add_argument(
        "--seqs", type=int, nargs="+", default=[2048, 8192], help="the training table's sequence lengths (batch 8)"
    )
    parser.add_argument("--training-only", action="store_true", help="skip the decode table")
    parser.add_argument("--decode-only", action="store_true", help="skip the training table")
    parser.add_argument(
        "--decode-batches", type=int, nargs="+", default=[1, 16, 64], help="the decode table's batch sizes"
    )
    parser.add_argument(
        "--decode-caches", type=int, nargs="+", default=[4096, 32768], help="the decode table's cache lengths"
    )
    parser.add_argument(
        "--decode-heads",
        type=int,
        nargs=2,
        default=[32, 8],
        metavar=("N", "K"),
        help="the decode shapes' query and KV heads",
    )
    parser.add_argument("--profile", action="store_true", help="the first training shape's forward, 3 calls (ncu)")
    parser.add_argument("--trace-decode", action="store_true", help="profile the decode shapes' calls and exit")
    parser.add_argument(
        "--profile-decode", action="store_true", help="batch-1 decode steps at 4096 and 32768, 3 calls each (ncu)"
    )
    args = parser.parse_args()
    if args.trace_decode:
        on_gpu = jax.devices()[0].platform == "gpu"
        shapes = [(b, s, 32, 8, args.head_dim) for b, s in ((1, 4096), (1, 32768), (16, 32768))]
        shapes = [shape for shape in shapes if shape[0] in args.decode_batches]
        trace_decode(shapes if on_gpu else [(2, 256, 4, 2, 64)], jnp.bfloat16, on_gpu)
        return
    if args.sanitize:
        sanitize()
        return
    if args.profile:
        B, T, N, K, D = 8, 2048, 32, 8, args.head_dim
        q, k, v = (
            rand(0, (B, T, N, D), jnp.bfloat16),
            rand(1, (B, T, K, D), jnp.bfloat16),
            rand(2, (B, T, K, D), jnp.bfloat16),
        )
        forward = jax.jit(lambda q, k, v: jaxdet.attention(q, k, v))
        for _ in range(3):
            jax.block_until_ready(forward(q, k, v))
        return
    if args.profile_decode:
        for S in (4096, 32768):
            step_args = decode_inputs(1, S, 32, 8, args.head_dim, jnp.bfloat16)
            for _ in range(3):
                jax.block_until_ready(decode_step(*step_args))
        return
    dev = jax.devices()[0]
    on_gpu = dev.platform == "gpu"
    peak = next((bw for name, bw in PEAK_BANDWIDTH.items() if name in dev.device_kind), None)
    print(header("bfloat16") + "\n", flush=True)
    if args.tiny:
        training([(1, 128, 4, 2, 64)], jnp.bfloat16, on_gpu, reps=2)
        decode([(2, 256, 4, 2, 64)], jnp.bfloat16, on_gpu, reps=2, peak=peak)
        return
    D = args.head_dim
    if not args.decode_only:
        training([(8, T, 32, 8, D) for T in args.seqs], jnp.bfloat16, on_gpu, args.reps)
    if not args.training_only:
        N, K = args.decode_heads
        shapes = [(b, s, N, K, D) for b in args.decode_batches for s in args.decode_caches]
        decode(shapes, jnp.bfloat16, on_gpu, args.reps, peak)


if __name__ == "__main__":
    main()
