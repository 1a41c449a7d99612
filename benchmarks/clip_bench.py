"""Benchmark: jaxdet.clip_by_global_norm vs optax.clip_by_global_norm, side by side in one run.

    python benchmarks/clip_bench.py                 # GPU: markdown table for benchmarks/RESULTS.md
    python benchmarks/clip_bench.py --sanitize      # each kernel once on small trees (compute-sanitizer)
    python benchmarks/clip_bench.py --allow-cpu --reps 3 --calls 2 --loop 2   # smoke test without a GPU
    python benchmarks/clip_bench.py --trace         # where the in-jit loop's time goes (profiler)
    python benchmarks/clip_bench.py --compile       # jit compile time against the leaf count

Trees: the GPT-2-small gradient tree (148 float32 leaves, 124.4M values; shapes from
/work/shared/reference/baselines.md; one fused call) and a seeded 1000-leaf tree of mixed sizes
(1 .. 2^20 values, log-uniform) and dtypes (float32 / bfloat16 / float16 in turn; more leaves
than one aliased call takes, so it runs staged: partials and apply in groups, one finalize).

Both functions are jitted and timed the same way: warm-up, then the median over `--reps` runs of
`--calls` back-to-back calls (one jax.block_until_ready at the end of each run, time divided by the
calls). Two input modes:
  * donated: every call gets a fresh copy of the tree with donate_argnums=0 -- how clipping runs
    inside a jitted train step, where the gradients are dead after clipping (jaxdet clips in place);
  * kept: the tree is a live (non-donated) jit argument, so XLA must copy it to honour jaxdet's
    input/output aliasing (optax writes new buffers anyway).
A third mode, in-jit loop, runs clips inside one jitted `lax.fori_loop` (one dispatch), with max_norm
halved each iteration so that every iteration clips, and reports the marginal time per clip of a
loop of 3n clips against a loop of n (n = `--loop`): the host's dispatch of the tree's arguments,
which dominates per-call timings for 1000 leaves (several ms), is paid once per loop and cancels.
max_norm is far below the norm, so every call really clips (3 passes). The floor is the 3-pass
bandwidth bound: (read all + read all + write all) bytes at the copy bandwidth measured in this run
with `x * 1.5` on a 1 GiB float32 array (GPU) (read + write bytes / time). A cell that fails (out of
memory) shows "OOM" or the exception's class and the run goes on (_timing.guard).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import failed, guard, header  # noqa: E402

import jaxdet  # noqa: E402

GPT2_BLOCK = [
    (768,),
    (768,),
    (768, 2304),
    (2304,),
    (768, 768),
    (768,),
    (768,),
    (768,),
    (768, 3072),
    (3072,),
    (3072, 768),
    (768,),
]
GPT2_SHAPES = [(50257, 768), (1024, 768)] + GPT2_BLOCK * 12 + [(768,), (768,)]


def _normal(rng, shape, dtype, device):
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(1e-2)
    return jax.device_put(jnp.asarray(x, dtype), device)  # host-made: no per-shape compilation


def gpt2_tree(device, scale_down=1):
    rng = np.random.default_rng(0)
    return [_normal(rng, (max(1, s[0] // scale_down),) + s[1:], jnp.float32, device) for s in GPT2_SHAPES]


def mixed_tree(device, n_leaves=1000, max_log2=20, scale_down=1):
    rng = np.random.default_rng(1)
    sizes = np.exp(rng.uniform(0, max_log2 * np.log(2), n_leaves)).astype(np.int64) // scale_down
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
    leaves = []
    for i, n in enumerate(sizes):
        shape = (int(n),) if i % 2 else (int(max(1, n // 64)), 64)
        leaves.append(_normal(rng, shape, dtypes[i % 3], device))
    return leaves


@jax.jit
def max_abs_diff(a, b):
    diffs = [jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)), initial=0.0) for x, y in zip(a, b)]
    return jnp.max(jnp.stack(diffs))


def tree_bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def copy_of(tree):
    return jax.tree.map(lambda x: x.copy(), tree)


def time_calls(fn, make_input, calls, reps, warmup=3):
    for _ in range(warmup):
        jax.block_until_ready(fn(make_input()))
    per_call = []
    for _ in range(reps):
        inputs = [make_input() for _ in range(calls)]
        jax.block_until_ready(inputs)
        t0 = time.perf_counter()
        outs = [fn(x) for x in inputs]
        jax.block_until_ready(outs)
        per_call.append((time.perf_counter() - t0) / calls)
        del outs, inputs
    return statistics.median(per_call) * 1e3


def loop_fn(clip, iters):
    """`iters` clips in one dispatch; max_norm halves every iteration, so each one really clips."""

    def run(tree):
        def body(i, carry):
            t, m = carry
            return clip(t, m), m * 0.5

        # max_norm rides in the carry as a weakly typed scalar (a Python float), so optax's
        # `leaf * max_norm` keeps each leaf's dtype, as it does with a Python max_norm.
        return jax.lax.fori_loop(0, iters, body, (tree, 1e-3))[0]

    return jax.jit(run, donate_argnums=0)


def loop_bodies():
    """The clip of each implementation as a loop body: (tree, max_norm) -> clipped tree."""
    import optax

    return {
        "jaxdet": lambda t, m: jaxdet.clip_by_global_norm(t, m)[0],
        "optax": lambda t, m: (lambda tx: tx.update(t, tx.init(t))[0])(optax.clip_by_global_norm(m)),
    }


def time_loop(fn, make_input, iters, reps):
    """Median wall time of one call of fn (a jitted loop of `iters` clips), in ms."""
    jax.block_until_ready(fn(make_input()))
    times = []
    for _ in range(reps):
        x = make_input()
        jax.block_until_ready(x)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_per_clip(clip, make_input, iters, reps):
    """Marginal time of one clip inside a jitted loop: (loop of 3n clips - loop of n clips) / 2n.

    One call of a loop pays the host's dispatch of the whole tree once (about 7 ms for 1000
    leaves); the difference of two loop lengths cancels it and leaves the device time per clip.
    """
    short = time_loop(loop_fn(clip, iters), make_input, iters, reps)
    long = time_loop(loop_fn(clip, 3 * iters), make_input, 3 * iters, reps)
    return (long - short) / (2 * iters)


def copy_bandwidth(device, reps):
    n = 256 * 1024 * 1024 if device.platform == "gpu" else 16 * 1024 * 1024
    x = jax.device_put(jnp.ones((n,), jnp.float32), device)
    f = jax.jit(lambda x: x * 1.5)
    ms = time_calls(f, lambda: x, calls=5, reps=reps)
    return 2 * x.size * 4 / (ms * 1e-3)  # bytes/s, read + write


def progress(row):
    name, _, _, _, mode, t_jd, t_ox, floor_ms, *_ = row
    print(
        f"[{time.strftime('%H:%M:%S')}] {name}, {mode}: jaxdet {t_jd:.3f} ms, optax {t_ox:.3f} ms, "
        f"floor {floor_ms:.3f} ms",
        file=sys.stderr,
        flush=True,
    )


def bench(args):
    import optax

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.allow_cpu:
        sys.exit("clip_bench.py needs a GPU (pass --allow-cpu for a smoke test)")
    bw = guard(copy_bandwidth, device, args.reps)
    max_norm = 1e-3  # far below both trees' norms: every call clips
    jd = lambda t: jaxdet.clip_by_global_norm(t, max_norm)  # noqa: E731
    ox_tx = optax.clip_by_global_norm(max_norm)
    ox = lambda t: ox_tx.update(t, ox_tx.init(t))[0]  # noqa: E731
    loop_clips = loop_bodies()
    fns = {
        "jaxdet": {"donated": jax.jit(jd, donate_argnums=0), "kept": jax.jit(jd)},
        "optax": {"donated": jax.jit(ox, donate_argnums=0), "kept": jax.jit(ox)},
    }
    down = 1 if device.platform == "gpu" else 64  # --allow-cpu smoke test: smaller trees
    trees = {
        "GPT-2-small (148 f32 leaves, 124.4M values)": lambda: gpt2_tree(device, down),
        "1000 leaves, mixed sizes, f32/bf16/f16": lambda: mixed_tree(device, scale_down=down),
    }

    rows = []
    refs = {}
    for name, make_tree in trees.items():
        tree = guard(make_tree)
        if failed(tree):
            for mode in ("in-jit loop", "donated", "kept"):
                rows.append((name, "-", "-", tree, mode, tree, tree, tree, tree, tree))
            refs[name] = tree
            continue
        nbytes = tree_bytes(tree)
        floor_ms = 3 * nbytes / bw * 1e3
        n_values = sum(x.size for x in tree)

        def agreement(tree=tree):
            """Sanity: the same clipped values as optax (to rounding) on this tree, and the norm."""
            c_jd, norm = fns["jaxdet"]["kept"](tree)
            c_ox = fns["optax"]["kept"](tree)
            return float(norm), float(max_abs_diff(c_jd, c_ox))

        checked = guard(agreement)
        norm, err = (checked, checked) if failed(checked) else checked
        copies = lambda tree=tree: copy_of(tree)
        loop_reps = max(3, args.reps // 3)
        t_jd = guard(time_per_clip, loop_clips["jaxdet"], copies, args.loop, loop_reps)
        t_ox = guard(time_per_clip, loop_clips["optax"], copies, args.loop, loop_reps)
        rows.append((name, len(tree), n_values, nbytes, "in-jit loop", t_jd, t_ox, floor_ms, norm, err))
        progress(rows[-1])
        # What any jitted per-call function of this tree pays: the host's dispatch of its leaves
        # plus one read and one write of each (2/3 of the clip floor's traffic).
        scale = jax.jit(lambda t: jax.tree.map(lambda x: x * 1.5, t), donate_argnums=0)
        refs[name] = guard(time_calls, scale, copies, args.calls, args.reps)
        print(
            f"[{time.strftime('%H:%M:%S')}] {name}, per-call reference x * 1.5: {refs[name]:.3f} ms",
            file=sys.stderr,
            flush=True,
        )
        for mode in ("donated", "kept"):
            make = copies if mode == "donated" else (lambda tree=tree: tree)
            t_jd = guard(time_calls, lambda t, mode=mode: fns["jaxdet"][mode](t), make, args.calls, args.reps)
            t_ox = guard(time_calls, lambda t, mode=mode: fns["optax"][mode](t), make, args.calls, args.reps)
            rows.append((name, len(tree), n_values, nbytes, mode, t_jd, t_ox, floor_ms, norm, err))
            progress(rows[-1])
        del tree

    bw_mib = 1024 if device.platform == "gpu" else 64
    print(f"\n### Global-norm clipping: jaxdet vs optax\n\n{header(f'optax {optax.__version__}')}\n")
    print(
        f"Copy bandwidth (`x * 1.5`, {bw_mib} MiB f32, read + write): {bw / 1e12:.2f} TB/s. "
        f"Median of {args.reps} runs of {args.calls} back-to-back jitted calls; max_norm={max_norm} (always clips).\n"
    )
    print("| tree | leaves | MB | inputs | jaxdet ms | optax ms | optax / jaxdet | 3-pass floor ms | jaxdet / floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, leaves, _n_values, nbytes, mode, t_jd, t_ox, floor_ms, _norm, _err in rows:
        vs_optax = "-" if failed(t_jd) or failed(t_ox) else f"{t_ox / t_jd:.2f}x"
        vs_floor = "-" if failed(t_jd) or failed(floor_ms) else f"{t_jd / floor_ms:.2f}x"
        print(
            f"| {name} | {leaves} | {nbytes / 1e6:.0f} | {mode} | {t_jd:.3f} | {t_ox:.3f} | {vs_optax} | "
            f"{floor_ms:.3f} | {vs_floor} |"
        )
    print()
    for name, *_, norm, err in rows[::3]:
        print(f"- {name}: norm {norm:.6g}; max |jaxdet - optax| over clipped values {err:.3g}")
    print(
        f"- in-jit loop: time per clip inside a jitted fori_loop, (loop of {3 * args.loop} - loop of "
        f"{args.loop}) / {2 * args.loop}: device time without the host's per-call dispatch of the tree "
        "(which the difference cancels); the targets are judged on these rows."
    )
    for name, ms in refs.items():
        print(
            f"- {name}: a jitted donated `x * 1.5` of every leaf (dispatch plus one read and one write) "
            f"takes {ms:.3f} ms per call: the per-call rows cannot go below the host's dispatch of the leaves."
        )
    print(
        "- donated: fresh donated copy per call (as inside a train step); kept: non-donated argument "
        "(XLA copies the tree first to honour jaxdet's in-place aliasing)."
    )


def trace(args):
    """Profiler view of the in-jit loops (device busy vs span, kernels, host events)."""

    from trace_summary import traced

    device = jax.devices()[0]
    down = 1 if device.platform == "gpu" else 64
    loops = {impl: loop_fn(clip, args.loop) for impl, clip in loop_bodies().items()}
    for name, make in (
        ("GPT-2-small", lambda: gpt2_tree(device, down)),
        ("1000 leaves mixed", lambda: mixed_tree(device, scale_down=down)),
    ):
        for impl, fn in loops.items():
            tree = make()
            # the loop donates its argument: hand each of the two calls its own copy
            copies = iter([copy_of(tree), copy_of(tree)])
            print(f"\n#### trace: {impl}, {name}, in-jit loop of {args.loop}\n")
            print(traced(lambda t: fn(next(copies)), (None,)))


def sanitize():
    """Each kernel once, small: partial and whole chunks, all dtypes, empty and 0-d leaves, > 1024
    leaves (several launches), identity / multiply / zero modes, global_norm."""
    rng = np.random.default_rng(0)
    dtypes = [jnp.float32, jnp.bfloat16, jnp.float16]
    small = [
        jnp.asarray(rng.standard_normal(n).astype(np.float32)).astype(dtypes[i % 3])
        for i, n in enumerate([0, 1, 3, 4095, 4096, 4097, 3 * 4096 + 5, 20000])
    ]
    small.append(jnp.float32(2.0))
    many = [
        jnp.asarray(rng.standard_normal(int(n)).astype(np.float32)).astype(dtypes[i % 3])
        for i, n in enumerate(rng.integers(0, 300, 1100))
    ]
    bad = small + [jnp.asarray(np.array([1.0, np.inf], np.float32))]
    runs = [
        ("clip multiply", small, 0.5, "propagate"),
        ("clip identity", small, 1e9, "propagate"),
        ("clip many leaves", many, 0.5, "propagate"),
        ("clip skip (zero)", bad, 0.5, "skip"),
        ("clip propagate inf", bad, 0.5, "propagate"),
        ("clip empty tree", [], 1.0, "propagate"),
    ]
    for name, tree, max_norm, policy in runs:
        # jit without donation: XLA copies the inputs, so the kernels run out of the aliased copies.
        out = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, max_norm, nonfinite=policy))(tree)
        jax.block_until_ready(out)
        print(f"{name}: norm {float(out[1]):.6g}")
    for name, tree in (("global_norm", small), ("global_norm many", many), ("global_norm empty", [])):
        print(f"{name}: {float(jax.block_until_ready(jaxdet.global_norm(tree))):.6g}")
    # vmap: the staged kernels over a batch of examples, one decision each (identity, multiply, zero).
    batch = [jnp.stack([x, x * 1e-6, x.at[...].set(jnp.inf) if x.size else x]) for x in small[1:8]]
    for policy in ("propagate", "skip"):
        out = jax.jit(jax.vmap(lambda t: jaxdet.clip_by_global_norm(t, 0.5, nonfinite=policy)))(batch)
        print(f"vmap clip {policy}: norms {np.asarray(jax.block_until_ready(out[1]))}")
    print("sanitize runs done on", jax.devices()[0])


def compile_seconds(fn, donate, tree):
    lowered = jax.jit(fn, donate_argnums=donate).lower(tree)
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start


def compile_times(args):
    """Compile time of jit(clip_by_global_norm) against the leaf count, next to a jit of the same tree
    that only doubles each leaf (what any jit with that many outputs costs), with the gradients
    donated (as in a train step) and not donated (XLA then copies every aliased leaf first: one
    copy kernel per leaf). The tree is a gradient tree's mix: sizes 0 to 12288, float32, bfloat16
    and float16 in turn."""
    device = jax.devices()[0]
    print(header() + "\n")
    print("| leaves | clip, donated (s) | x * 2, donated (s) | clip, not donated (s) | x * 2, not donated (s) |")
    print("|---:|---:|---:|---:|---:|")
    dtypes = (jnp.float32, jnp.bfloat16, jnp.float16)
    for n in args.compile_leaves:
        rng = np.random.default_rng(11)
        sizes = rng.integers(0, 3 * 4096, n)
        tree = [jax.device_put(jnp.ones((int(k),), dtypes[i % 3]), device) for i, k in enumerate(sizes)]
        row = [str(n)]
        for donate in ((0,), ()):
            for fn in (lambda t: jaxdet.clip_by_global_norm(t, 1.0), lambda t: [x * 2 for x in t]):
                row.append(f"{guard(compile_seconds, fn, donate, tree):.2f}")
        print("| " + " | ".join(row) + " |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sanitize", action="store_true", help="run each kernel once on small inputs and exit")
    p.add_argument("--allow-cpu", action="store_true", help="allow running without a GPU (smoke test)")
    p.add_argument("--reps", type=int, default=30, help="runs per cell (the median is reported)")
    p.add_argument("--calls", type=int, default=10, help="back-to-back calls per run")
    p.add_argument("--loop", type=int, default=20, help="clips per dispatch in the in-jit loop mode")
    p.add_argument("--trace", action="store_true", help="profile the in-jit loops (jax.profiler) and exit")
    p.add_argument("--compile", action="store_true", help="jit compile time against the leaf count and exit")
    p.add_argument("--compile-leaves", type=int, nargs="+", default=[250, 1000, 3000])
    args = p.parse_args()
    if args.sanitize:
        sanitize()
    elif args.compile:
        compile_times(args)
    elif args.trace:
        trace(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
