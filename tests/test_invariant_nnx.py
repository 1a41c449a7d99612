"""jaxdet.invariant on a Flax NNX model built from flax's own modules, with no jaxdet call
(nnx.Embed, nnx.RMSNorm, nnx.MultiHeadAttention with its decode cache, nnx.Linear SwiGLU, an
untied head): rows alone == rows in batches, flax's decode loop == the one-pass forward, and the
in-place `nnx.jit` train step (docs/invariant.md)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxdet
from jaxdet.testing import assert_bitwise_equal

VOCAB, D, HEADS, FF, LAYERS, MAX_LEN = 53, 32, 4, 64, 2, 24


class Block(nnx.Module):
    def __init__(self, rngs, dtype):
        self.attn_norm = nnx.RMSNorm(D, rngs=rngs, dtype=dtype)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, decode=False, rngs=rngs, dtype=dtype, use_bias=False
        )
        self.mlp_norm = nnx.RMSNorm(D, rngs=rngs, dtype=dtype)
        self.gate = nnx.Linear(D, FF, use_bias=False, rngs=rngs, dtype=dtype)
        self.up = nnx.Linear(D, FF, use_bias=False, rngs=rngs, dtype=dtype)
        self.down = nnx.Linear(FF, D, use_bias=False, rngs=rngs, dtype=dtype)

    def __call__(self, x, mask=None, decode=False):
        x = x + self.attn(self.attn_norm(x), mask=mask, decode=decode)
        h = self.mlp_norm(x)
        return x + self.down(nnx.silu(self.gate(h)) * self.up(h))


class Model(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float32):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs, dtype=dtype)
        self.blocks = nnx.List([Block(rngs, dtype) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(D, rngs=rngs, dtype=dtype)
        self.head = nnx.Linear(D, VOCAB, rngs=rngs, dtype=dtype)

    def __call__(self, tokens, decode=False):
        x = self.embed(tokens)
        mask = None if decode else nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask=mask, decode=decode)
        return self.head(self.norm(x))


def log_probs(model, tokens, targets):
    lp = jax.nn.log_softmax(model(tokens).astype(jnp.float32))
    return jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]


def _batch(key, B, T):
    t = jax.random.randint(jax.random.key(key), (B, T + 1), 0, VOCAB)
    return t[:, :-1], t[:, 1:]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nnx_log_probs_rows_alone_equal_rows_in_batches(dtype):
    model = Model(nnx.Rngs(0), dtype)
    tokens, targets = _batch(1, 6, 12)
    lp = nnx.jit(jaxdet.invariant(log_probs))
    full = lp(model, tokens, targets)
    assert_bitwise_equal(lp(model, tokens[2:3], targets[2:3]), full[2:3])
    assert_bitwise_equal(lp(model, tokens[::-1], targets[::-1]), full[::-1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_nnx_decode_cache_equals_the_one_pass_forward(dtype):
    """flax's own decode: MultiHeadAttention(decode=True) keeps a full-length cache and masks the
    positions not yet written."""
    model = Model(nnx.Rngs(0), dtype)
    B, T = 2, 9
    tokens, _ = _batch(2, B, T)
    logits = nnx.jit(jaxdet.invariant(lambda m, t: m(t)))(model, tokens)
    for block in model.blocks:
        block.attn.init_cache((B, MAX_LEN, D), dtype=dtype)
    step = nnx.jit(jaxdet.invariant(lambda m, t: m(t, decode=True)))
    for t in range(T):
        out = step(model, tokens[:, t : t + 1])
        assert_bitwise_equal(out[:, 0], logits[:, t])


def test_nnx_in_place_train_step():
    """The standard in-place step (the optimizer updates the model; only the loss is returned):
    the update is evaluated by the rules and written back; two runs give the same bits, close to
    the untransformed step."""

    def train_step(model, optimizer, tokens, targets):
        loss, grads = nnx.value_and_grad(lambda m: -jnp.mean(log_probs(m, tokens, targets)))(model)
        optimizer.update(model, grads)
        return loss

    tokens, targets = _batch(3, 4, 10)
    runs = []
    for transform in (jaxdet.invariant, jaxdet.invariant, lambda f: f):
        model = Model(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = nnx.jit(transform(train_step))
        losses = [step(model, optimizer, tokens, targets) for _ in range(3)]
        runs.append((losses, nnx.state(model, nnx.Param)))
    (l1, p1), (l2, p2), (l3, p3) = runs
    jax.tree.map(assert_bitwise_equal, (l1, p1), (l2, p2))
    assert not np.array_equal(np.asarray(l1[0]), np.asarray(l1[-1]))  # the model was updated in place
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p3)):
        assert float(jnp.max(jnp.abs(a - b))) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_nnx_rows_decode_and_train_step(dtype, on_gpu):
    """The same contracts on the GPU: rows alone == in batches, flax's decode cache == the
    one-pass forward, and two runs of the in-place step give the same bits."""
    test_nnx_log_probs_rows_alone_equal_rows_in_batches(dtype)
    test_nnx_decode_cache_equals_the_one_pass_forward(dtype)
    if dtype == jnp.float32:
        with jax.default_matmul_precision("highest"):  # the untransformed twin without TF32
            test_nnx_in_place_train_step()
