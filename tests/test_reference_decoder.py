"""The reference decoder (jaxdet.models.decoder): per-token log-probs and input-gradient rows of a
sequence are bitwise the same alone and inside batches of 4 to 64 (docs/reference_decoder.md)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdet
from jaxdet.models import decoder
from jaxdet.testing import assert_batch_invariant, assert_bitwise_equal, assert_deterministic

CFG = decoder.DecoderConfig(vocab=128, d_model=128, n_heads=2, n_layers=2, d_ff=128, max_len=32)
SEQ = 17  # 16 next-token log-probs per sequence
SIZES = (1, 4, 16, 64)
_NEEDS = ("rms_norm", "softmax", "softmax_cross_entropy")


@pytest.fixture
def norms():
    """The decoder needs the row primitives; in a build without them, its tests skip."""
    missing = [f"jaxdet.{n}" for n in _NEEDS if not hasattr(jaxdet, n)]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (the norm, softmax and cross-entropy primitives)")


def _setup(dtype=jnp.float32):
    cfg = decoder.DecoderConfig(**{**CFG.__dict__, "dtype": dtype})
    params = decoder.init(jax.random.key(0), cfg)
    tokens = jax.random.randint(jax.random.key(1), (64, SEQ), 0, cfg.vocab, jnp.int32)
    return cfg, params, tokens


def test_config_is_checked():
    with pytest.raises(ValueError, match="d_model .* must be a multiple of n_heads"):
        decoder.DecoderConfig(d_model=65, n_heads=4)
    with pytest.raises(ValueError, match="n_layers must be a positive int"):
        decoder.DecoderConfig(n_layers=0)
    with pytest.raises(ValueError, match="dtype must be"):
        decoder.DecoderConfig(dtype=jnp.float64)
    with pytest.raises(ValueError, match="head dimension that jaxdet.attention supports"):
        decoder.DecoderConfig(d_model=64, n_heads=4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_log_probs_of_a_sequence_do_not_depend_on_the_batch(norms, dtype):
    cfg, params, tokens = _setup(dtype)
    assert_batch_invariant(
        lambda t: decoder.token_log_probs(params, t, cfg), tokens, sizes=SIZES, what="token_log_probs"
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_input_gradient_rows_do_not_depend_on_the_batch(norms, dtype):
    cfg, params, tokens = _setup(dtype)
    x = decoder.embed(params, tokens[:, :-1], cfg)

    def grad_rows(batch):
        x, targets = batch
        # The losses of different sequences share no computation, so the gradient of their sum
        # holds each sequence's own gradient in its row.
        return jax.grad(lambda e: jnp.sum(decoder.token_losses(params, e, targets, cfg)))(x)

    assert_batch_invariant(grad_rows, (x, tokens[:, 1:]), sizes=SIZES, what="input gradient")


def test_causal_prefix_is_bitwise_unchanged_by_later_tokens(norms):
    cfg, params, tokens = _setup()
    changed = tokens.at[:, 9:].set((tokens[:, 9:] + 1) % cfg.vocab)
    a = decoder.token_log_probs(params, tokens, cfg)
    b = decoder.token_log_probs(params, changed, cfg)
    assert_bitwise_equal(b[:, :8], a[:, :8], "log-probs before the change")  # predictions of tokens 1..8
    assert not np.array_equal(np.asarray(a[:, 8:]), np.asarray(b[:, 8:]))


def _reference_log_probs(params, tokens, cfg):
    """The same decoder in float64 NumPy."""
    p = jax.tree.map(lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64), params)
    tokens = np.asarray(tokens)
    inp, targets = tokens[:, :-1], tokens[:, 1:]
    b, s = inp.shape
    h, dh = cfg.n_heads, cfg.head_dim

    def rms(x, scale):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.eps) * scale

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    x = p["tok"][inp] + p["pos"][np.arange(s)][None]
    mask = np.tril(np.ones((s, s), bool))
    for blk in p["blocks"]:
        qkv = (rms(x, blk["norm1"]) @ blk["qkv"]).reshape(b, s, 3, h, dh).transpose(2, 0, 3, 1, 4)
        scores = np.where(mask, qkv[0] @ qkv[1].swapaxes(-1, -2) / math.sqrt(dh), -np.inf)
        att = np.exp(log_softmax(scores)) @ qkv[2]
        x = x + att.transpose(0, 2, 1, 3).reshape(b, s, -1) @ blk["proj"]
        x = x + gelu(rms(x, blk["norm2"]) @ blk["up"]) @ blk["down"]
    logp = log_softmax(rms(x, p["norm"]) @ p["out"])
    return np.take_along_axis(logp, targets[..., None], -1)[..., 0]


def test_log_probs_match_a_float64_reference(norms):
    cfg, params, tokens = _setup()
    got = np.asarray(decoder.token_log_probs(params, tokens[:8], cfg), np.float64)
    want = _reference_log_probs(params, tokens[:8], cfg)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_audit_finds_nothing(norms):
    cfg, params, tokens = _setup()
    report = jaxdet.audit(lambda p, t: decoder.token_log_probs(p, t, cfg), params, tokens, batch_argnums=1, strict=True)
    assert report.ok and not report.findings, str(report)
    x = decoder.embed(params, tokens[:, :-1], cfg)

    def train_grads(p, x, targets):  # parameter and input gradients
        return jax.grad(lambda p, e: jnp.sum(decoder.token_losses(p, e, targets, cfg)), argnums=(0, 1))(p, x)

    for backend in ("cpu", "gpu"):
        report = jaxdet.audit(train_grads, params, x, tokens[:, 1:], batch_argnums=(1, 2), strict=True, backend=backend)
        assert report.ok and not report.findings, str(report)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("prompt,capacity", [(1, SEQ), (5, SEQ), (16, 3 * SEQ)])
def test_decode_loop_log_probs_equal_the_training_forward(norms, dtype, prompt, capacity):
    # A prompt in one call, then one token per step against a KV cache: the sampler's log-probs
    # are the trainer's, bit for bit. Both sides compiled (jax.jit): XLA may fuse the elementwise
    # GELU and residual adds differently in an op-by-op (eager) run.
    cfg, params, tokens = _setup(dtype)
    train = jax.jit(lambda p, t: decoder.token_log_probs(p, t, cfg))(params, tokens[:8])
    decode = jax.jit(lambda p, t: decoder.decode_log_probs(p, t, cfg, prompt=prompt, capacity=capacity))
    assert_bitwise_equal(decode(params, tokens[:8]), train, "decode-loop log-probs")


def test_extend_with_per_sequence_positions(norms):
    # Sequences at different lengths in one decode step (ragged prompts).
    cfg, params, tokens = _setup()
    train = jax.jit(lambda p, t: decoder.logits(p, t, cfg))(params, tokens[:2])
    extend = jax.jit(lambda p, c, t, s: decoder.extend(p, c, t, s, cfg))
    _, cache = extend(params, decoder.init_cache(cfg, 2, SEQ), tokens[:2, :6], jnp.zeros(2, jnp.int32))
    start = jnp.asarray([3, 6])  # sequence 0 continues at position 3 (its cache past 3 is never read)
    step = jnp.stack([tokens[0, 3], tokens[1, 6]])[:, None]
    logits, _ = extend(params, cache, step, start)
    assert_bitwise_equal(logits[0, 0], train[0, 3])
    assert_bitwise_equal(logits[1, 0], train[1, 6])


def test_remat_gives_the_same_bits(norms):
    """Each block under jax.checkpoint (forward(remat=True)): the same losses and gradients, bitwise."""
    cfg, params, tokens = _setup(jnp.bfloat16)
    x = decoder.embed(params, tokens[:8, :-1], cfg)

    def loss_and_grads(remat):
        def loss(params, x):
            return jnp.sum(decoder.token_losses(params, x, tokens[:8, 1:], cfg, remat=remat))

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)

    got, want = jax.tree.leaves(loss_and_grads(True)), jax.tree.leaves(loss_and_grads(False))
    assert len(got) == len(want) > 2
    for a, b in zip(got, want):
        assert_bitwise_equal(a, b, "remat vs plain")


def test_deterministic(norms):
    cfg, params, tokens = _setup()
    assert_deterministic(lambda p, t: decoder.token_log_probs(p, t, cfg), params, tokens[:16], runs=2, recompile=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_log_probs_and_gradient_rows_do_not_depend_on_the_batch(norms, gpu, dtype):
    with jax.default_device(gpu):
        cfg, params, tokens = _setup(dtype)
        assert_batch_invariant(lambda t: decoder.token_log_probs(params, t, cfg), tokens, sizes=SIZES)
        x = decoder.embed(params, tokens[:, :-1], cfg)
        grad = jax.grad(lambda e, t: jnp.sum(decoder.token_losses(params, e, t, cfg)))
        assert_batch_invariant(lambda b: grad(*b), (x, tokens[:, 1:]), sizes=SIZES)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpu_decode_loop_log_probs_equal_the_training_forward(norms, gpu, dtype):
    with jax.default_device(gpu):
        cfg, params, tokens = _setup(dtype)
        train = jax.jit(lambda p, t: decoder.token_log_probs(p, t, cfg))(params, tokens[:8])
        for prompt, capacity in ((1, SEQ), (7, 4 * SEQ)):
            decode = jax.jit(lambda p, t: decoder.decode_log_probs(p, t, cfg, prompt=prompt, capacity=capacity))
            assert_bitwise_equal(decode(params, tokens[:8]), train, "decode-loop log-probs")


def test_out_of_range_inputs_are_refused():
    """Out-of-vocabulary tokens, positions past max_len and KV-cache overflow raise ValueError
    (concrete inputs) instead of embedding zero rows or clamping the cache write."""
    cfg, params, tokens = _setup()
    bad = tokens[:2].at[1, 3].set(cfg.vocab)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, vocab=128\), got 128 at \[1, 3\]"):
        decoder.token_log_probs(params, bad, cfg)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, vocab=128\), got -1"):
        decoder.embed(params, tokens[:2].at[0, 0].set(-1), cfg)
    with pytest.raises(ValueError, match="tokens must be in"):
        decoder.decode_log_probs(params, bad, cfg, prompt=2)
    cache = decoder.init_cache(cfg, 2, 8)
    with pytest.raises(ValueError, match="tokens must be in"):
        decoder.extend(params, cache, bad[:, 2:4], 0, cfg)
    # KV-cache overflow: 8 positions of capacity.
    with pytest.raises(ValueError, match="overflow the KV cache of capacity 8"):
        decoder.extend(params, cache, tokens[:2, :2], 7, cfg)
    with pytest.raises(ValueError, match="overflow the KV cache of capacity 8"):
        decoder.extend(params, cache, tokens[:2, :1], jnp.array([3, 8], jnp.int32), cfg)
    with pytest.raises(ValueError, match="do not fit a KV cache of capacity 8"):
        decoder.extend(params, cache, tokens[:2, :9], 0, cfg)
    with pytest.raises(ValueError, match="start must be >= 0"):
        decoder.extend(params, cache, tokens[:2, :1], -1, cfg)
    # Positions past max_len (32), with a cache large enough.
    big = decoder.init_cache(cfg, 2, 40)
    with pytest.raises(ValueError, match="positions up to 32 .* past the config's max_len=32"):
        decoder.extend(params, big, tokens[:2, :1], 32, cfg)
    with pytest.raises(ValueError, match="max_len=32"):
        decoder.token_log_probs(params, jnp.zeros((1, 33), jnp.int32), cfg)
    # In range, the last position of both the table and the cache is fine.
    logits, _ = decoder.extend(params, decoder.init_cache(cfg, 2, 32), tokens[:2, :1], 31, cfg)
    assert logits.shape == (2, 1, cfg.vocab)
