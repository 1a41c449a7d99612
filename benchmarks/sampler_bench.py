"""Benchmark: jaxdet.sampling's sampler (decode tokens/s at batch 1, 16 and 64) and the trainer's
log-prob forward, with jaxdet's modules vs the same Llama with flax's own modules (plain JAX),
docs/sampling.md.

    python benchmarks/sampler_bench.py                       # GPU: d 2048, 8 layers, vocab 32000, bf16
    python benchmarks/sampler_bench.py --allow-cpu --small   # smoke test without a GPU
    python benchmarks/sampler_bench.py --steps-per-call 1    # decode calls of one step only
    python benchmarks/sampler_bench.py --trace 64            # where a decode window's time goes

Decode: a `jaxdet.sampling.Sampler` with one slot per request (`--batches`), each request's prompt
(`--prompt` tokens) fed in one step, then `--decode-steps` steps of one token per slot at
temperature 1 timed (median of `--reps` windows, jaxdet's and plain JAX's alternating), host
bookkeeping included, as a user runs it, in calls of each `--steps-per-call` decode steps (default
1, the Sampler's default, and 8, where the device's time dominates); tokens/s =
batch x steps / seconds. Plain JAX runs the same Sampler over the model built with
`modules="flax"` (jax.nn.dot_product_attention over the masked cache, with each `--plain`
implementation: "xla", and "cudnn" on a GPU).

Trainer: `trainer_log_probs` of a padded batch (`--train-batch` x `--seq`) under `nnx.jit`,
against the flax model's logits through `jax.nn.log_softmax` and a gather (plain JAX).

`--trace B` instead profiles one window of decode steps at batch B for jaxdet and each plain
implementation (jax.profiler; trace_summary.py): the kernels by total time, the device's busy
fraction of the window (idle: waiting for the host) and the host's events.

Ratios: jaxdet's speed over the fastest plain JAX that ran (decode: its tokens/s over plain's;
trainer: plain's time over its), so that below 1 is slower. A cell that fails (out of memory, an
implementation this device lacks) prints its failure and the rest runs (_timing.guard).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import trace_summary  # noqa: E402
from _timing import failed, guard  # noqa: E402
from flax import nnx  # noqa: E402

import jaxdet  # noqa: E402
from jaxdet import sampling  # noqa: E402
from jaxdet.models.llama import Llama, LlamaConfig  # noqa: E402


def make_model(args, modules, attention="xla"):
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        d_ff=args.d_ff,
        max_len=max(args.seq, args.prompt + args.decode_steps + 1),
        dtype=args.dtype,
        param_dtype=args.dtype,
        modules=modules,
        attention=attention,
    )
    return Llama(cfg, rngs=nnx.Rngs(0))


def _decode_window(model, args, batch, steps_per_call):
    """A Sampler of `batch` slots over `model`, and `window(rep, around=None)`: the seconds of one
    window of `args.decode_steps` decode steps (one request per slot, prompts fed in one step
    before the window); `around`, if given, is a context manager entered around the steps."""
    capacity = args.prompt + args.decode_steps + 1
    sampler = sampling.Sampler(
        model, num_slots=batch, capacity=capacity, prefill_chunk=args.prompt, steps_per_call=steps_per_call
    )
    rng = np.random.default_rng(0)
    key = jaxdet.random.key(0)

    def window(rep, around=None):
        for i in range(batch):
            sampler.add_request(
                rng.integers(0, args.vocab, args.prompt),
                max_new_tokens=args.decode_steps + 1,
                temperature=1.0,
                key=jaxdet.random.fold_in(key, rep * batch + i),
            )
        sampler.step()  # the prompts, in one step; every request draws its first token
        finished = []
        with around or contextlib.nullcontext():
            start = time.perf_counter()
            while sampler.has_work():  # the last call's tokens reach the host: the window is complete
                finished += sampler.step()
            seconds = time.perf_counter() - start
        assert len(finished) == batch and not sampler.has_work(), "every request ends in the window"
        return seconds

    return window


def decode_tokens_per_second(models, args, batch, steps_per_call):
    """Median tokens/s of each model over `args.reps` windows of `args.decode_steps` decode steps
    (after one window each that compiles and warms up). The models' windows alternate, so that
    the host's load (a step is mostly host time at these sizes) falls on every model alike."""
    windows = {name: guard(_decode_window, model, args, batch, steps_per_call) for name, model in models.items()}
    seconds = {name: [] for name in models}
    for rep in range(args.reps + 1):
        for name, window in windows.items():
            if failed(window):
                continue
            took = guard(window, rep)
            if failed(took):
                windows[name] = took
            else:
                seconds[name].append(took)
    return {
        name: window if failed(window) else statistics.median(batch * args.decode_steps / s for s in seconds[name][1:])
        for name, window in windows.items()
    }


def decode_trace(model, args, batch, log_dir="/tmp/jaxdet-sampler-trace"):
    """The profile of the second window of decode steps at `batch` (the first compiles), in calls of
    the first `--steps-per-call` value, summarised."""

    @contextlib.contextmanager
    def profiled():
        shutil.rmtree(log_dir, ignore_errors=True)
        jax.profiler.start_trace(log_dir, create_perfetto_trace=True)
        try:
            yield
        finally:
            jax.profiler.stop_trace()

    window = _decode_window(model, args, batch, args.steps_per_call[0])
    window(0)
    seconds = window(1, around=profiled())
    return f"window: {args.decode_steps} steps in {seconds * 1e3:.2f} ms (profiled)\n" + trace_summary.summarize(
        log_dir, top=25
    )


def trainer_seconds(model, tokens, reps, plain):
    if plain:

        @nnx.jit
        def score(model, tokens):
            lp = jax.nn.log_softmax(model(tokens)[:, :-1].astype(jnp.float32), axis=-1)
            return jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]

    else:
        score = nnx.jit(sampling.trainer_log_probs)
    return _timing.timed(score, model, tokens, reps=reps, inner=2)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="d 128, 2 layers, vocab 512, short sequences (CPU smoke)")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no GPU")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--d-ff", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument(
        "--steps-per-call",
        type=int,
        nargs="+",
        default=[1, 8],
        help="the Sampler's steps_per_call values (decode steps per device call)",
    )
    p.add_argument("--train-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--plain", nargs="+", default=["xla", "cudnn"], choices=["xla", "cudnn"])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--trace", type=int, metavar="B", help="profile a decode window at batch B instead of timing")
    args = p.parse_args()
    if jax.default_backend() == "cpu" and not args.allow_cpu:
        sys.exit("no GPU: pass --allow-cpu (with --small) for a smoke test")
    if jax.default_backend() == "cpu":
        args.plain = [impl for impl in args.plain if impl != "cudnn"]
    if args.small:
        args.d_model, args.layers, args.heads, args.kv_heads, args.d_ff, args.vocab = 128, 2, 2, 1, 256, 512
        args.prompt, args.decode_steps, args.seq, args.train_batch, args.reps = 16, 8, 64, 2, 2
        args.batches = [b for b in args.batches if b <= 16]
    args.dtype = jnp.dtype(args.dtype)
    print(_timing.header(f"sampler_bench: {vars(args)}") + "\n")

    models = {"jaxdet": guard(make_model, args, "jaxdet")}
    for impl in args.plain:
        models[f"plain ({impl})"] = guard(make_model, args, "flax", impl)
    plain_names = [name for name in models if name != "jaxdet"]
    if args.trace:
        for name, model in models.items():
            print(f"\n#### decode trace: {name}, batch {args.trace}\n", flush=True)
            print(guard(decode_trace, model, args, args.trace), flush=True)
        return

    # A Failed cell prints its label under any format spec (_timing.Failed).
    print("Decode (tokens/s, higher is better; ratio = jaxdet / the fastest plain)\n")
    print(f"| batch | steps per call | jaxdet | {' | '.join(plain_names)} | ratio |")
    print("|---:|---:|---:|" + "---:|" * len(plain_names) + "---:|")
    for steps_per_call in args.steps_per_call:
        for batch in args.batches:
            rates = decode_tokens_per_second(models, args, batch, steps_per_call)
            ran = [rates[name] for name in plain_names if not failed(rates[name])]
            ratio = rates["jaxdet"] / max(ran) if ran else _timing.Failed("-")
            cells = " | ".join(f"{rates[name]:.0f}" for name in plain_names)
            print(f"| {batch} | {steps_per_call} | {rates['jaxdet']:.0f} | {cells} | {ratio:.2f} |", flush=True)

    print(
        f"\nTrainer log-prob forward, {args.train_batch} x {args.seq} tokens (ms, lower is better; ratio = the "
        "fastest plain's time / jaxdet's)\n"
    )
    tokens = jax.random.randint(jax.random.key(1), (args.train_batch, args.seq), 0, args.vocab)
    times = {name: guard(trainer_seconds, model, tokens, args.reps, name != "jaxdet") for name, model in models.items()}
    _, best = _timing.fastest({name: times[name] for name in plain_names})
    print(f"| jaxdet | {' | '.join(plain_names)} | ratio |")
    print("|---:|" + "---:|" * len(plain_names) + "---:|")
    cells = " | ".join(f"{times[name] * 1e3:.2f}" for name in plain_names)
    print(f"| {times['jaxdet'] * 1e3:.2f} | {cells} | {best / times['jaxdet']:.2f} |")


if __name__ == "__main__":
    main()
