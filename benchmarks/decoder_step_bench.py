"""Benchmark: one training step of the reference decoder (jaxdet ops only) vs the same model in
plain JAX, side by side (docs/reference_decoder.md).

    python benchmarks/decoder_step_bench.py                    # GPU: d=2048, 16 layers, seq 2048, batch 8, bf16
    python benchmarks/decoder_step_bench.py --layers 8 --batch 4   # the issue's size (d 2048, seq 2048, bf16)
    python benchmarks/decoder_step_bench.py --remat            # each block under jax.checkpoint (all models)
    python benchmarks/decoder_step_bench.py --allow-cpu --small  # smoke test without a GPU

All models have the parameters of ``jaxdet.models.decoder.init`` and the same architecture
(pre-norm blocks, causal attention, GELU MLP, untied output layer, per-token cross-entropy). The
jaxdet step is ``decoder.token_losses`` (one-hot embeddings through ``jaxdet.matmul``,
``jaxdet.rms_norm``, ``jaxdet.attention``, ``jaxdet.softmax_cross_entropy``); the plain JAX steps
use gathers for the embeddings, ``@``, a float32-statistics RMSNorm (norm_bench.py's jnp version),
``optax.softmax_cross_entropy_with_integer_labels`` and ``jax.nn.dot_product_attention`` with each
implementation of --plain: ``xla`` (what the default, ``implementation=None``, runs) and ``cudnn``
(cuDNN's fused attention, JAX's fastest path on an H100; GPU only). A step is the mean token loss,
its gradient with respect to every parameter, and an SGD update (donated).

ratio = jaxdet step time / the fastest plain JAX step that ran (goal: <= 1.15); the
table also gives jaxdet's time over each plain step. A model whose step fails (out of memory, an
attention implementation this device lacks) shows "OOM" or the exception's class in its row and
the others still run (_timing.guard).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import norm_bench  # noqa: E402
from _timing import failed, guard  # noqa: E402

from jaxdet.models import decoder  # noqa: E402

LR = 1e-3


def plain_losses(params, tokens, targets, cfg, remat=False, attention=None):
    """The reference decoder's architecture in plain JAX: per-token losses [batch, seq].
    attention: jax.nn.dot_product_attention's implementation (None: its default, XLA)."""

    assert cfg.eps == norm_bench.EPS, "the jnp RMSNorm of norm_bench.py uses its EPS"
    rms_norm = norm_bench.jnp_rms_norm

    def block_forward(x, block):
        b, s, _ = x.shape
        qkv = (rms_norm(x, block["norm1"]) @ block["qkv"]).reshape(b, s, 3, cfg.n_heads, cfg.head_dim)
        out = jax.nn.dot_product_attention(
            qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True, implementation=attention
        )
        x = x + out.reshape(b, s, cfg.d_model) @ block["proj"]
        return x + jax.nn.gelu(rms_norm(x, block["norm2"]) @ block["up"]) @ block["down"]

    step = jax.checkpoint(block_forward) if remat else block_forward
    x = params["tok"][tokens] + params["pos"][jnp.arange(tokens.shape[1])][None]
    for block in params["blocks"]:
        x = step(x, block)
    hidden = rms_norm(x, params["norm"])
    logits = jnp.dot(hidden, params["out"], preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


def jaxdet_losses(params, tokens, targets, cfg, remat=False):
    return decoder.token_losses(params, decoder.embed(params, tokens, cfg), targets, cfg, remat=remat)


def make_step(losses, cfg, remat):
    def loss(params, tokens, targets):
        return jnp.mean(losses(params, tokens, targets, cfg, remat=remat))

    def step(params, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        return jax.tree.map(lambda p, g: (p - LR * g).astype(p.dtype), params, grads), value

    return jax.jit(step, donate_argnums=0)


# --plain choices: the name in the table and jax.nn.dot_product_attention's implementation
PLAIN = {"xla": ("plain JAX, default attention (XLA)", None), "cudnn": ("plain JAX, cuDNN attention", "cudnn")}


def time_step(losses, cfg, key, inputs, targets, remat, reps):
    """Median seconds per step (two steps per sample) of the model whose per-token losses are
    `losses`, from fresh parameters."""
    step = make_step(losses, cfg, remat)
    # (init shares one array among the norm scales: a distinct buffer each, for donation)
    state = {"params": jax.tree.map(jnp.copy, decoder.init(key, cfg))}

    def run():
        state["params"], value = step(state["params"], inputs, targets)
        return value

    try:
        return _timing.timed(run, reps=reps, inner=2)
    finally:
        state.clear()  # the parameters (and, after a failure, whatever they hold) go now


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="d=256, 2 layers, seq 64, batch 2, vocab 512 (CPU smoke test)")
    p.add_argument("--allow-cpu", action="store_true", help="run on the CPU when there is no GPU")
    p.add_argument("--d-model", type=int, default=2048, help="model width (heads of 128; d_ff 4 x d_model)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--plain",
        default="xla,cudnn",
        help="plain JAX baselines, comma-separated: xla (the default implementation of "
        "jax.nn.dot_product_attention), cudnn (GPU only; skipped on the CPU)",
    )
    p.add_argument("--remat", action="store_true", help="each block under jax.checkpoint, in every model")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    plain = [name.strip() for name in args.plain.split(",") if name.strip()]
    unknown = [name for name in plain if name not in PLAIN]
    if unknown:
        p.error(f"--plain: unknown baseline(s) {unknown}; choose from {sorted(PLAIN)}")
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.allow_cpu:
        raise SystemExit("no GPU (pass --allow-cpu --small for a smoke test)")
    if device.platform != "gpu" and "cudnn" in plain:
        plain.remove("cudnn")  # cuDNN attention is GPU only
        print("(plain JAX with cuDNN attention: skipped, no GPU)")
    if args.small:
        cfg = decoder.DecoderConfig(vocab=512, d_model=256, n_heads=4, n_layers=2, d_ff=1024, max_len=64)
        batch, seq = 2, 64
    else:
        cfg = decoder.DecoderConfig(
            vocab=args.vocab,
            d_model=args.d_model,
            n_heads=args.d_model // 128,
            n_layers=args.layers,
            d_ff=4 * args.d_model,
            max_len=args.seq,
            dtype=jnp.bfloat16,
        )
        batch, seq = args.batch, args.seq
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (batch, seq + 1), 0, cfg.vocab)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    print(
        _timing.header(
            f"d_model {cfg.d_model}, {cfg.n_layers} layers, heads {cfg.n_heads}, d_ff {cfg.d_ff}, vocab {cfg.vocab}, "
            f"batch {batch}, seq {seq}, {jnp.dtype(cfg.dtype).name}; SGD step"
            f"{', blocks rematerialized' if args.remat else ''}, median of {args.reps} x 2 steps"
        )
        + "\n"
    )
    models = [(PLAIN[name][0], functools.partial(plain_losses, attention=PLAIN[name][1])) for name in plain]
    models.append(("jaxdet", jaxdet_losses))
    times = {}
    for name, losses in models:
        times[name] = guard(time_step, losses, cfg, key, inputs, targets, args.remat, args.reps)
        print(f"[{name}: {times[name] if failed(times[name]) else f'{times[name] * 1e3:.1f} ms'}]", flush=True)
    mine = times.pop("jaxdet")
    print("\n| model | step ms | jaxdet / this |\n|---|---|---|")
    for name, t in times.items():
        ratio = "-" if failed(t) or failed(mine) else f"{mine / t:.3f}"
        print(f"| {name} | {t if failed(t) else f'{t * 1e3:.1f}'} | {ratio} |")
    print(f"| jaxdet | {mine if failed(mine) else f'{mine * 1e3:.1f}'} | {'-' if failed(mine) else '1.000'} |")
    best_name, best = _timing.fastest(times)
    if best_name is None or failed(mine):
        print("\nratio (jaxdet / fastest plain JAX step time): - (a side did not run)")
    else:
        print(f"\nratio (jaxdet / fastest plain JAX step time, {best_name}): {mine / best:.3f}")


if __name__ == "__main__":
    main()
