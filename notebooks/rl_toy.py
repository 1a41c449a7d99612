"""A GRPO-style on-policy RL loop on a toy verifiable task, small enough to learn on a CPU in a
minute: the example behind notebooks/rl_on_policy.ipynb (and tests/test_rl.py).

The task: a prompt is [BOS, a, b] with digits a, b; the reward of a completion is the fraction of
its tokens equal to b. Each step samples `group_size` completions per prompt with
`jaxdet.sampling.Sampler` (continuous batching over a KV cache), scores the same sequences with
`jaxdet.sampling.trainer_log_probs` (one packed forward) inside the gradient of a clipped GRPO
objective, and records |log p_sampler - log p_trainer| and the importance ratio of every token.
With jaxdet's modules the ratio is exactly 1.0 on every token at every step; with flax's own
modules (plain JAX) it drifts; under jaxdet.invariant it is exactly 1.0 again (docs/rl.md)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxdet
from jaxdet import sampling

DIGITS = 10
BOS = 10
VOCAB = 16  # the digits, BOS and unused ids


@dataclasses.dataclass(frozen=True)
class RLConfig:
    steps: int = 40
    prompts_per_step: int = 8
    group_size: int = 8
    new_tokens: int = 4
    temperature: float = 1.0
    learning_rate: float = 3e-3
    clip_epsilon: float = 0.2
    num_slots: int = 32
    seed: int = 0


def make_prompts(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    return [np.array([BOS, *rng.integers(0, DIGITS, 2)], np.int32) for _ in range(n)]


def reward(prompt: np.ndarray, tokens: np.ndarray) -> float:
    """The verifier: the fraction of the completion's tokens equal to the prompt's last digit."""
    return float(np.mean(tokens == prompt[-1]))


def group_advantages(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """GRPO's advantages: each reward minus its group's mean, over the group's standard deviation."""
    r = rewards.reshape(-1, group_size)
    return ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-4)).reshape(-1)


@dataclasses.dataclass
class History:
    reward: list = dataclasses.field(default_factory=list)  # mean reward per step
    abs_diff: list = dataclasses.field(default_factory=list)  # |lp_sampler - lp_trainer| per token, per step
    ratio: list = dataclasses.field(default_factory=list)  # the importance ratio per token, per step


def train(model, cfg: RLConfig = RLConfig(), *, invariant: bool = False, verbose: bool = False) -> History:
    """Runs `cfg.steps` GRPO steps on `model` (updated in place); returns the history."""
    rng = np.random.default_rng(cfg.seed)
    optimizer = nnx.Optimizer(model, optax.adam(cfg.learning_rate), wrt=nnx.Param)
    sampler = sampling.Sampler(model, num_slots=cfg.num_slots, capacity=16, prefill_chunk=4, invariant=invariant)
    seq_len = 3 + cfg.new_tokens
    row = 8 * seq_len  # 8 sequences per packed row

    @nnx.jit
    def train_step(model, optimizer, tokens, segment_ids, sampler_lp, advantages, mask):
        def loss_fn(model):
            lp = sampling.trainer_log_probs(
                model, tokens, segment_ids=segment_ids, temperature=cfg.temperature, invariant=invariant
            )
            ratio = jnp.exp(lp - sampler_lp)
            clipped = jnp.clip(ratio, 1 - cfg.clip_epsilon, 1 + cfg.clip_epsilon)
            objective = jnp.minimum(ratio * advantages, clipped * advantages)
            return -jnp.sum(jnp.where(mask, objective, 0.0)) / jnp.sum(mask), (lp, ratio)

        (_, (lp, ratio)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return lp, ratio

    history = History()
    for step in range(cfg.steps):
        prompts = [p for p in make_prompts(rng, cfg.prompts_per_step) for _ in range(cfg.group_size)]
        completions = sampler.generate(
            prompts,
            max_new_tokens=cfg.new_tokens,
            temperature=cfg.temperature,
            key=jaxdet.random.fold_in(jaxdet.random.key(cfg.seed), step),
        )
        rewards = np.array([reward(c.prompt, c.tokens) for c in completions])
        advantages = group_advantages(rewards, cfg.group_size)
        layout = sampling.pack_sequences([c.sequence for c in completions], length=row)
        mask = layout.mask(begin=[c.prompt.size for c in completions])
        sampler_lp = np.zeros(layout.tokens.shape, np.float32)
        token_adv = np.zeros(layout.tokens.shape, np.float32)
        for c, a, r, s in zip(completions, advantages, layout.row, layout.start):
            sampler_lp[r, s + c.prompt.size : s + c.prompt.size + c.tokens.size] = c.log_probs
            token_adv[r, s : s + c.sequence.size] = a
        lp, ratio = train_step(model, optimizer, layout.tokens, layout.segment_ids, sampler_lp, token_adv, mask)
        history.reward.append(float(rewards.mean()))
        history.abs_diff.append(np.abs(np.asarray(lp) - sampler_lp)[mask])
        history.ratio.append(np.asarray(ratio)[mask])
        if verbose:
            print(
                f"step {step:3d}  reward {rewards.mean():.3f}  max |dlogp| {history.abs_diff[-1].max():.2e}  "
                f"ratio in [{history.ratio[-1].min():.7f}, {history.ratio[-1].max():.7f}]"
            )
    return history
