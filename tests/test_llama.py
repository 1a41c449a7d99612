"""jaxdet.models.llama: the Llama-style NNX decoder (docs/flax.md, "A Llama in Flax NNX").

Tiny configs on the CPU (head_dim 64): checkpoint names and round trip; modules="jaxdet" and
modules="flax" against a float64 NumPy reference; with modules="jaxdet", a sequence's logits have
the same bits alone, in a padded batch, packed with segment_ids, and through ``extend`` token by
token or in chunks next to other slots; an ``nnx.jit`` train step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")

import jaxdet  # noqa: E402
from jaxdet.models.llama import KVCache, Llama, LlamaConfig, from_checkpoint, to_checkpoint  # noqa: E402
from jaxdet.testing import assert_bitwise_equal  # noqa: E402

TINY = LlamaConfig(vocab_size=97, d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=256, max_len=32)
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


# Every forward under nnx.jit: one compilation per shape instead of one per eager op (the bits are
# the same eager or jitted; what the contract varies is the batch).
FORWARD = nnx.jit(lambda model, t, segment_ids=None: model(t, segment_ids=segment_ids))
EXTEND = nnx.jit(lambda model, t, positions, cache: model.extend(t, positions, cache))


def config(dtype=jnp.float32, **kw):
    return dataclasses.replace(TINY, dtype=dtype, param_dtype=dtype, **kw)


def tokens(seed, shape, cfg=TINY):
    return jax.random.randint(jax.random.key(seed), shape, 0, cfg.vocab_size, jnp.int32)


def reference_logits(cfg, flat, seq):
    """float64 NumPy forward of one sequence from the checkpoint dict."""
    f = {k: np.asarray(v, np.float64) for k, v in flat.items()}
    hd, N, K = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    T = len(seq)

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * w

    inv = 1.0 / (cfg.rope_theta ** (np.arange(hd // 2) * 2.0 / hd))
    ang = np.arange(T)[:, None] * inv
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(x):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    x = f["model.embed_tokens.weight"][np.asarray(seq)]
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        h = rms(x, f[p + "input_layernorm.weight"])
        q = rope((h @ f[p + "self_attn.q_proj.weight"].T).reshape(T, N, hd))
        k = rope((h @ f[p + "self_attn.k_proj.weight"].T).reshape(T, K, hd))
        v = (h @ f[p + "self_attn.v_proj.weight"].T).reshape(T, K, hd)
        k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)
        s = np.einsum("tnd,snd->nts", q, k) / np.sqrt(hd)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("nts,snd->tnd", w / w.sum(-1, keepdims=True), v).reshape(T, N * hd)
        x = x + a @ f[p + "self_attn.o_proj.weight"].T
        h = rms(x, f[p + "post_attention_layernorm.weight"])
        gate = h @ f[p + "mlp.gate_proj.weight"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ f[p + "mlp.up_proj.weight"].T)) @ f[p + "mlp.down_proj.weight"].T
    head = f["model.embed_tokens.weight"] if cfg.tie_embeddings else f["lm_head.weight"]
    return rms(x, f["model.norm.weight"]) @ head.T


def rel_err(x, ref):
    x = np.asarray(x, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# ---- Checkpoints. ----


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_checkpoint_round_trip_with_the_llama_names(tie, dtype):
    cfg = config(dtype, tie_embeddings=tie)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    flat = to_checkpoint(model)
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not tie else set())
    for i in range(cfg.n_layers):
        names |= {f"model.layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
        names |= {f"model.layers.{i}.self_attn.{p}_proj.weight" for p in "qkvo"}
        names |= {f"model.layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    assert set(flat) == names
    hd = cfg.head_dim
    assert flat["model.layers.0.self_attn.k_proj.weight"].shape == (cfg.n_kv_heads * hd, cfg.d_model)  # [out, in]
    assert flat["model.layers.1.mlp.down_proj.weight"].shape == (cfg.d_model, cfg.d_ff)
    assert all(v.dtype == np.dtype(dtype) for v in flat.values())
    loaded = from_checkpoint(cfg, flat, rngs=nnx.Rngs(5))
    assert_bitwise_equal(to_checkpoint(loaded), flat, "the round trip")
    t = tokens(1, (2, 7))
    assert_bitwise_equal(FORWARD(loaded, t), FORWARD(model, t), "the loaded model's logits")
    # The flax twin loads the same dict.
    assert_bitwise_equal(
        to_checkpoint(from_checkpoint(dataclasses.replace(cfg, modules="flax"), flat, rngs=nnx.Rngs(1))), flat
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fused_projections_give_the_bits_of_separate_products(dtype):
    # q|k|v and gate|up are one kernel each (one product per group in a decode step): each part of
    # the fused product has the bits of a jaxdet.matmul by that part's checkpoint weight alone.
    cfg = config(dtype)
    model = Llama(cfg, rngs=nnx.Rngs(3))
    flat = to_checkpoint(model)
    h = jax.random.normal(jax.random.key(4), (3, 5, cfg.d_model), jnp.float32).astype(dtype)
    layer, p = model.layers[1], "model.layers.1."
    fused = {
        "self_attn": (layer.self_attn.qkv_proj(h), ("q_proj", "k_proj", "v_proj")),
        "mlp": (layer.mlp.gate_up_proj(h), ("gate_proj", "up_proj")),
    }
    for group, (out, projs) in fused.items():
        at = 0
        for proj in projs:
            w = jnp.asarray(flat[f"{p}{group}.{proj}.weight"].T)
            assert_bitwise_equal(out[..., at : at + w.shape[1]], jaxdet.matmul(h, w), f"{group}.{proj}")
            at += w.shape[1]
        assert at == out.shape[-1]


def test_checkpoint_errors_name_the_entry():
    flat = to_checkpoint(Llama(TINY, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        from_checkpoint(TINY, {k: v for k, v in flat.items() if k != "model.norm.weight"}, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unexpected.*lm_head.weight"):
        from_checkpoint(dataclasses.replace(TINY, tie_embeddings=True), flat, rngs=nnx.Rngs(0))
    bad = dict(flat)
    bad["model.layers.0.self_attn.q_proj.weight"] = np.zeros((128, 64), np.float32)
    with pytest.raises(ValueError, match="q_proj.weight must have shape"):
        from_checkpoint(TINY, bad, rngs=nnx.Rngs(0))


def test_config_errors():
    with pytest.raises(ValueError, match="modules"):
        config(modules="torch")
    with pytest.raises(ValueError, match="cudnn"):
        config(attention="cudnn")  # modules="jaxdet" runs jaxdet.attention
    with pytest.raises(ValueError, match="n_kv_heads"):
        config(n_kv_heads=3)


# ---- Accuracy: both module sets against float64. ----


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_jaxdet_and_flax_modules_agree_with_float64(tie, dtype):
    cfg = config(dtype, tie_embeddings=tie)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    flat = to_checkpoint(model)
    twin = from_checkpoint(dataclasses.replace(cfg, modules="flax"), flat, rngs=nnx.Rngs(0))
    seq = tokens(2, (1, 12))
    ref = reference_logits(cfg, flat, seq[0])
    tol = 2e-6 if dtype == jnp.float32 else 3e-2
    ours, theirs = FORWARD(model, seq)[0], FORWARD(twin, seq)[0]
    assert ours.dtype == theirs.dtype == jnp.float32
    assert rel_err(ours, ref) < tol and rel_err(theirs, ref) < tol, (rel_err(ours, ref), rel_err(theirs, ref))


# ---- The bitwise contract of modules="jaxdet". ----


def run_extend(model, schedule, capacity, width=1):
    """Runs ``extend`` over calls of `width` tokens per slot (at least). schedule: per call, per slot, a list of
    (token, position) pairs (real tokens first); each slot is padded with positions continuing past
    its last token (a slot with nothing real gets positions past the capacity, which are dropped).
    Returns, per slot, the logits of its real tokens in order."""
    B = len(schedule[0])
    cache = model.init_cache(B, capacity)
    got = [[] for _ in range(B)]
    for call in schedule:
        w = max([width] + [len(slot) for slot in call])
        toks, pos = np.zeros((B, w), np.int32), np.zeros((B, w), np.int32)
        for b, slot in enumerate(call):
            last = slot[-1][1] if slot else capacity - 1
            for j in range(w):
                toks[b, j], pos[b, j] = slot[j] if j < len(slot) else (7, last + 1 + j - len(slot))
        logits, cache = EXTEND(model, jnp.asarray(toks), jnp.asarray(pos), cache)
        assert isinstance(cache, KVCache) and cache.capacity == capacity
        for b, slot in enumerate(call):
            got[b].extend(np.asarray(logits[b, : len(slot)]))
    return [np.stack(g) if g else None for g in got]


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_a_sequences_logits_have_the_same_bits_alone_padded_packed_and_through_extend(dtype):
    cfg = config(dtype)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    T = 11
    seq = tokens(3, (T,))
    other = tokens(4, (20,))
    alone = FORWARD(model, seq[None])[0]

    padded = (
        jnp.zeros((3, T + 5), jnp.int32).at[0].set(other[: T + 5]).at[1, :T].set(seq).at[2].set(other[::-1][: T + 5])
    )
    assert_bitwise_equal(FORWARD(model, padded)[1, :T], alone, "in a right-padded batch")

    packed = jnp.concatenate([other[:3], seq, other[3:8]])[None]
    segments = jnp.array([[0] * 3 + [1] * T + [2] * 5])
    assert_bitwise_equal(FORWARD(model, packed, segments)[0, 3 : 3 + T], alone, "packed with segment_ids")

    pairs = [(int(seq[t]), t) for t in range(T)]
    neighbour = [(int(other[t]), t) for t in range(20)]
    one_by_one = [[pairs[t : t + 1], neighbour[t : t + 1]] for t in range(T)]
    assert_bitwise_equal(run_extend(model, one_by_one, 16)[0], alone, "token by token through extend")

    cuts = [0, 4, 5, 9, T]  # chunks of 4, 1, 4, 2 tokens; the neighbour prefills 7, then 1 per call, then idles
    chunked = [
        [pairs[cuts[i] : cuts[i + 1]], neighbour[:7] if i == 0 else ([neighbour[6 + i]] if i < 3 else [])]
        for i in range(len(cuts) - 1)
    ]
    out = run_extend(model, chunked, cfg.max_len, width=4)
    assert_bitwise_equal(out[0], alone, "in chunks, next to another slot")
    assert_bitwise_equal(out[1], FORWARD(model, other[None, :9])[0], "the neighbour slot")


def test_flax_modules_are_plain_jax():
    twin = Llama(config(modules="flax"), rngs=nnx.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda t: twin(t))(tokens(0, (2, 5)))
    assert not [e for e in jaxpr.eqns if "jaxdet" in str(e.primitive)], "a jaxdet op in the flax twin"
    cache = twin.init_cache(2, 8)
    logits, _ = EXTEND(twin, tokens(0, (2, 5)), jnp.broadcast_to(jnp.arange(5), (2, 5)), cache)
    assert rel_err(logits, np.asarray(FORWARD(twin, tokens(0, (2, 5))), np.float64)) < 1e-6


def test_the_flax_twin_under_jaxdet_invariant_is_batch_invariant_and_decodes_the_prefills_bits():
    twin = Llama(dataclasses.replace(TINY, n_layers=1, modules="flax"), rngs=nnx.Rngs(0))
    t = tokens(6, (3, 10))
    forward = nnx.jit(jaxdet.invariant(lambda m, t: m(t)))
    whole = forward(twin, t)
    assert_bitwise_equal(forward(twin, t[1:2]), whole[1:2], "a row alone")
    extend = nnx.jit(jaxdet.invariant(lambda m, t, p, c: m.extend(t, p, c)))
    cache, steps = twin.init_cache(3, 16), []
    for i in range(10):
        logits, cache = extend(twin, t[:, i : i + 1], jnp.full((3, 1), i, jnp.int32), cache)
        steps.append(logits)
    assert_bitwise_equal(jnp.concatenate(steps, axis=1), whole, "extend token by token")


# ---- Training. ----


@pytest.mark.parametrize("modules", ["jaxdet", "flax"])
def test_nnx_jit_train_step(modules):
    model = Llama(config(modules=modules), rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    batch = tokens(5, (2, 9))

    @nnx.jit
    def step(model, optimizer, batch):
        def loss_fn(m):
            logits = m(batch[:, :-1])
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, batch)) for _ in range(3)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def test_the_jaxdet_llamas_gradient_is_clean_under_the_audit_and_the_flax_twins_is_not():
    t = jnp.ones((2, 9), jnp.int32)

    def step(model, t):
        def loss(m):
            return jaxdet.sum(jaxdet.softmax_cross_entropy_with_integer_labels(m(t[:, :-1]), t[:, 1:]))

        return nnx.state(nnx.grad(loss)(model))

    small = dataclasses.replace(TINY, n_layers=1)
    report = jaxdet.audit(step, Llama(small, rngs=nnx.Rngs(0)), t, batch_argnums=1, strict=True)
    assert report.ok and not report.findings, str(report)
    twin = Llama(dataclasses.replace(small, modules="flax"), rngs=nnx.Rngs(0))
    assert not jaxdet.audit(step, twin, t, batch_argnums=1).ok


# ---- GPU. ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_gpu_same_bits_alone_padded_packed_and_through_extend(on_gpu, dtype):
    test_a_sequences_logits_have_the_same_bits_alone_padded_packed_and_through_extend(dtype)


@pytest.mark.gpu
def test_gpu_jaxdet_and_flax_agree_with_float64_and_the_cpu(on_gpu):
    cfg = config(jnp.bfloat16)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    seq = tokens(2, (1, 12))
    gpu_logits = model(seq)
    with jax.default_device(jax.devices("cpu")[0]):
        cpu_model = from_checkpoint(cfg, to_checkpoint(model), rngs=nnx.Rngs(0))
        cpu_logits = cpu_model(jax.device_put(seq, jax.devices("cpu")[0]))
    assert rel_err(gpu_logits[0], reference_logits(cfg, to_checkpoint(model), seq[0])) < 3e-2
    assert rel_err(cpu_logits[0], np.asarray(gpu_logits[0], np.float64)) < 3e-2
    for attention in ("xla", "cudnn"):
        twin = from_checkpoint(
            dataclasses.replace(cfg, modules="flax", attention=attention), to_checkpoint(model), rngs=nnx.Rngs(0)
        )
        assert rel_err(twin(seq)[0], reference_logits(cfg, to_checkpoint(model), seq[0])) < 3e-2
    assert jaxdet.WITH_CUDA
