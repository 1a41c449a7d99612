"""Benchmark: one training step of the reference decoder (jaxdet ops only) vs the same model in
plain JAX, side by side (Step 8's full-model ratio; docs/reference_decoder.md).

    python benchmarks/decoder_step_bench.py                    # GPU: d=2048, 16 layers, seq 2048, batch 8, bf16
    python benchmarks/decoder_step_bench.py --remat            # each block under jax.checkpoint (both)
    python benchmarks/decoder_step_bench.py --allow-cpu --small  # smoke test without a GPU

Both models have the parameters of ``jaxdet.models.decoder.init`` and the same architecture
(pre-norm blocks, causal attention, GELU MLP, untied output layer, per-token cross-entropy). The
jaxdet step is ``decoder.token_losses`` (one-hot embeddings through ``jaxdet.matmul``,
``jaxdet.rms_norm``, ``jaxdet.attention``, ``jaxdet.softmax_cross_entropy``); the plain step uses
gathers for the embeddings, ``@``, a float32-statistics RMSNorm, ``jax.nn.dot_product_attention``
(XLA picks cuDNN on an H100) and ``optax.softmax_cross_entropy_with_integer_labels``; the RMSNorm
is norm_bench.py's jnp version. A step is the mean token loss, its gradient with respect to every
parameter, and an SGD update (donated).
ratio = jaxdet step time / plain step time (the Step 8 goal is <= 1.15).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import norm_bench  # noqa: E402

from jaxdet.models import decoder  # noqa: E402

LR = 1e-3


def plain_losses(params, tokens, targets, cfg, remat=False):
    """The reference decoder's architecture in plain JAX: per-token losses [batch, seq]."""

    assert cfg.eps == norm_bench.EPS, "the jnp RMSNorm of norm_bench.py uses its EPS"
    rms_norm = norm_bench.jnp_rms_norm

    def block_forward(x, block):
        b, s, _ = x.shape
        qkv = (rms_norm(x, block["norm1"]) @ block["qkv"]).reshape(b, s, 3, cfg.heads, cfg.d_model // cfg.heads)
        out = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True)
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
        return jnp.mean(losses(params, tokens, targets, cfg, remat))

    def step(params, tokens, targets):
        value, grads = jax.value_and_grad(loss)(params, tokens, targets)
        return jax.tree.map(lambda p, g: (p - LR * g).astype(p.dtype), params, grads), value

    return jax.jit(step, donate_argnums=0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--small", action="store_true", help="d=256, 2 layers, seq 64, batch 2, vocab 512")
    p.add_argument("--allow-cpu", action="store_true")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--remat", action="store_true", help="each block under jax.checkpoint, in both models")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.allow_cpu:
        raise SystemExit("no GPU (pass --allow-cpu --small for a smoke test)")
    if args.small:
        cfg = decoder.DecoderConfig(vocab=512, d_model=256, heads=4, layers=2, d_ff=1024, max_len=64)
        batch, seq = 2, 64
    else:
        cfg = decoder.DecoderConfig(
            vocab=args.vocab,
            d_model=2048,
            heads=16,
            layers=args.layers,
            d_ff=8192,
            max_len=2048,
            dtype=jnp.bfloat16,
        )
        batch, seq = args.batch, 2048
    key = jax.random.key(0)
    tokens = jax.random.randint(key, (batch, seq + 1), 0, cfg.vocab)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    print(
        f"device: {device.device_kind}; jax {jax.__version__}; d_model {cfg.d_model}, {cfg.layers} layers, "
        f"heads {cfg.heads}, d_ff {cfg.d_ff}, vocab {cfg.vocab}, batch {batch}, seq {seq}, "
        f"{jnp.dtype(cfg.dtype).name}; SGD step{', blocks rematerialized' if args.remat else ''}, "
        f"median of {args.reps} x 2 steps\n"
    )
    print("| model | step ms |\n|---|---|", flush=True)
    times = {}
    for name, losses in (("plain JAX", plain_losses), ("jaxdet", jaxdet_losses)):
        step = make_step(losses, cfg, args.remat)
        # (init shares one array among the norm scales: a distinct buffer each, for donation)
        state = {"params": jax.tree.map(jnp.copy, decoder.init(key, cfg))}

        def run(step=step, state=state):
            state["params"], value = step(state["params"], inputs, targets)
            return value

        times[name] = _timing.timed(run, reps=args.reps, inner=2)
        print(f"| {name} | {times[name] * 1e3:.1f} |", flush=True)
        del state
    print(f"\nratio (jaxdet / plain JAX step time): {times['jaxdet'] / times['plain JAX']:.3f}")


if __name__ == "__main__":
    main()
