"""The on-policy RL loop of notebooks/rl_on_policy.ipynb (notebooks/rl_toy.py), a few steps of it:
with jaxdet's modules, and with flax's own modules under jaxdet.invariant, the importance ratio
between the sampler's and the trainer's log-probs is exactly 1.0 on every token at every step
(docs/rl.md)."""

import pathlib
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from jaxdet.models.llama import Llama, LlamaConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "notebooks"))
import rl_toy  # noqa: E402

CFG = rl_toy.RLConfig(steps=3, prompts_per_step=4, group_size=4, num_slots=8)


def _model(modules):
    cfg = LlamaConfig(
        vocab_size=rl_toy.VOCAB, d_model=64, n_layers=2, n_heads=1, n_kv_heads=1, d_ff=128, max_len=16, modules=modules
    )
    return Llama(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("modules, invariant", [("jaxdet", False), ("flax", True)], ids=["jaxdet", "flax-invariant"])
def test_importance_ratio_is_exactly_one_at_every_step(modules, invariant):
    model = _model(modules)
    before = jax.tree.leaves(nnx.state(model, nnx.Param))
    history = rl_toy.train(model, CFG, invariant=invariant)
    assert len(history.ratio) == CFG.steps
    for step, (ratio, diff) in enumerate(zip(history.ratio, history.abs_diff)):
        assert ratio.size == CFG.prompts_per_step * CFG.group_size * CFG.new_tokens
        assert np.all(diff == 0.0), f"step {step}: max |lp_sampler - lp_trainer| = {diff.max()}"
        assert np.all(ratio == 1.0), f"step {step}: ratio in [{ratio.min()}, {ratio.max()}]"
    after = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))  # it trained


def test_group_advantages_and_reward():
    adv = rl_toy.group_advantages(np.array([1.0, 0.0, 0.5, 0.5]), 2)
    np.testing.assert_allclose(adv, [1.0, -1.0, 0.0, 0.0], atol=1e-3)
    assert rl_toy.reward(np.array([rl_toy.BOS, 4, 3]), np.array([3, 3, 1, 3])) == 0.75


@pytest.mark.gpu
def test_gpu_importance_ratio_is_exactly_one(on_gpu):
    history = rl_toy.train(_model("jaxdet"), rl_toy.RLConfig(steps=5))
    assert all(np.all(r == 1.0) for r in history.ratio) and all(np.all(d == 0) for d in history.abs_diff)
