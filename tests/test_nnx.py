"""jaxdet.nnx: the Flax NNX drop-ins (docs/flax.md). flax's own tests of the same modules run against
them in tests/test_nnx_flax_upstream.py."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")

import jaxdet  # noqa: E402
import jaxdet.nnx as jnnx  # noqa: E402
from jaxdet.testing import assert_bitwise_equal  # noqa: E402

DTYPES = [jnp.float32, jnp.bfloat16]


def rel_err(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def normal(seed, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


# ---- The namespace. ----


def test_import_jaxdet_does_not_import_flax_and_a_missing_flax_names_pip_install(tmp_path):
    code = (
        "import sys; import jaxdet; assert 'flax' not in sys.modules, 'import jaxdet imported flax'\n"
        "sys.modules['flax'] = None\n"
        "try:\n    import jaxdet.nnx\nexcept ImportError as e:\n    print(e)\n"
    )
    # From another directory: in a source checkout's root, `import jaxdet` finds the source folder.
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "pip install flax" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "cls,flax_cls,args",
    [
        (jnnx.Linear, nnx.Linear, (6, 5)),
        (jnnx.Embed, nnx.Embed, (11, 6)),
        (jnnx.LayerNorm, nnx.LayerNorm, (6,)),
        (jnnx.RMSNorm, nnx.RMSNorm, (6,)),
    ],
)
@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_parameters_are_flaxs_and_a_flax_checkpoint_loads_unchanged(cls, flax_cls, args, param_dtype):
    ours = cls(*args, param_dtype=param_dtype, rngs=nnx.Rngs(3))
    theirs = flax_cls(*args, param_dtype=param_dtype, rngs=nnx.Rngs(3))
    assert isinstance(ours, flax_cls)
    s_ours, s_theirs = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
    assert_bitwise_equal(s_ours, s_theirs, "the same initial parameters")  # same names, shapes, dtypes, inits
    trained = jax.tree.map(lambda p: p + 1, s_theirs)
    nnx.update(ours, trained)
    assert_bitwise_equal(nnx.state(ours, nnx.Param), trained, "a flax state loaded into the drop-in")


# ---- Linear, dot_general, DotGeneral. ----


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_is_flaxs_to_rounding_and_row_invariant(dtype):
    ours = jnnx.Linear(64, 48, dtype=dtype, rngs=nnx.Rngs(0))
    theirs = nnx.Linear(64, 48, dtype=dtype, rngs=nnx.Rngs(0))
    nnx.update(theirs, jax.tree.map(lambda b: b + 0.5, nnx.state(theirs)))
    nnx.update(ours, nnx.state(theirs))
    x = normal(1, (4, 9, 64))
    ref = np.asarray(x, np.float64) @ np.asarray(ours.kernel[...], np.float64) + np.asarray(ours.bias[...])
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel_err(ours(x), ref) < tol and rel_err(theirs(x), ref) < tol
    assert ours(x).dtype == theirs(x).dtype == dtype
    whole = ours(x)
    assert_bitwise_equal(ours(x[2, 3]), whole[2, 3], "a row alone")
    assert_bitwise_equal(jax.jit(ours.__call__)(x[1:3, 2:7]), whole[1:3, 2:7], "rows in another batch")


def test_linear_gradients_are_the_canonical_sums():
    layer = jnnx.Linear(32, 16, rngs=nnx.Rngs(0))
    x, g = normal(1, (3, 7, 32)), normal(2, (3, 7, 16))
    grads = nnx.grad(lambda m: jnp.vdot(m(x), g))(layer)
    assert_bitwise_equal(grads.bias[...], jaxdet.sum(g, axis=(0, 1)), "dbias: jaxdet.sum over the tokens")
    assert_bitwise_equal(grads.kernel[...], jaxdet.matmul_weight_grad(x.reshape(-1, 32), g.reshape(-1, 16)), "dW")


def test_dot_general_any_dimension_numbers_and_linen_dense():
    x, w = normal(0, (2, 5, 3, 8)), normal(1, (3, 8, 6))
    dn = (((2, 3), (0, 1)), ((), ()))
    ref = jax.lax.dot_general(x, w, dn, precision="highest")
    assert rel_err(jnnx.dot_general(x, w, dn, precision=jax.lax.Precision.DEFAULT), ref) < 1e-6
    # nnx.LinearGeneral (as nnx.MultiHeadAttention builds its projections) with it, and linen's Dense
    # through the class, give jaxdet.nnx.Linear's bits.
    general = nnx.LinearGeneral((3, 8), 6, axis=(-2, -1), dot_general=jnnx.dot_general, rngs=nnx.Rngs(0))
    ref_general = jax.lax.dot_general(x, general.kernel[...], dn, precision="highest") + general.bias[...]
    assert rel_err(general(x), ref_general) < 1e-6
    linear = jnnx.Linear(8, 6, use_bias=False, rngs=nnx.Rngs(0))
    dense = linen.Dense(6, use_bias=False, dot_general_cls=jnnx.DotGeneral)
    params = {"params": {"kernel": linear.kernel[...]}}
    assert_bitwise_equal(dense.apply(params, x), linear(x), "linen Dense with jaxdet.nnx.DotGeneral")
    with pytest.raises(TypeError, match="precision"):
        jnnx.dot_general(x, w, dn, precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32)
    with pytest.raises(TypeError, match="one dtype"):
        jnnx.dot_general(x, w.astype(jnp.bfloat16), dn)


def test_out_sharding_types_the_result_under_explicit_sharding():
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    with jax.set_mesh(mesh):
        x = jax.device_put(normal(0, (2, 8)), P("data", None))
        linear = jnnx.Linear(8, 4, rngs=nnx.Rngs(0))
        assert jax.typeof(linear(x, out_sharding=P("data", None))).sharding.spec == P("data", None)
        embed = jnnx.Embed(5, 4, rngs=nnx.Rngs(0))
        ids = jnp.zeros((2, 3), jnp.int32)
        assert jax.typeof(embed(ids, out_sharding=P("data", None, None))).sharding.spec == P("data", None, None)
        assert_bitwise_equal(linear(x, out_sharding=P("data", None)), linear(x))


# ---- Embed. ----


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_is_jnp_take_and_its_gradient_is_segment_sum(dtype):
    layer = jnnx.Embed(13, 8, param_dtype=dtype, rngs=nnx.Rngs(0))
    ids = jnp.array([[0, 5, 5, 12], [-1, 3, 13, 5]])
    table = layer.embedding[...]
    assert_bitwise_equal(layer(ids), jnp.take(table, ids, axis=0), "jnp.take's values (NaN rows out of range)")
    g = normal(1, (2, 4, 8), dtype)
    grads = nnx.grad(lambda m: jnp.vdot(jnp.nan_to_num(m(ids)), g).real)(layer)
    assert_bitwise_equal(
        grads.embedding[...], jaxdet.segment_sum(g.reshape(8, 8), jnp.where(ids < 0, ids + 13, ids).reshape(-1), 13)
    )
    q = normal(2, (3, 8), dtype)
    ref = np.asarray(q, np.float64) @ np.asarray(table, np.float64).T
    assert rel_err(layer.attend(q), ref) < (1e-6 if dtype == jnp.float32 else 1e-2)
    with pytest.raises(ValueError, match="integer"):
        layer(jnp.ones((2,)))


# ---- LayerNorm, RMSNorm. ----


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("center", [True, False])
def test_norms_are_the_kernels_and_flaxs_to_rounding(dtype, center):
    cls, flax_cls, fn = (
        (jnnx.LayerNorm, nnx.LayerNorm, lambda x, m: jaxdet.layer_norm(x, m.scale[...], m.bias[...], eps=1e-5))
        if center
        else (jnnx.RMSNorm, nnx.RMSNorm, lambda x, m: jaxdet.rms_norm(x, m.scale[...], eps=1e-5))
    )
    ours = cls(64, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    theirs = flax_cls(64, epsilon=1e-5, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    x = normal(1, (3, 5, 64), dtype) * 3 + 1
    assert_bitwise_equal(ours(x), fn(x, ours), "one jaxdet kernel over the last axis")
    assert rel_err(ours(x), theirs(x)) < (1e-6 if dtype == jnp.float32 else 1e-2)
    assert ours(x).dtype == dtype
    # A float32 input with a bfloat16 result (no promotion, as linen): computed in float32 and rounded
    # once, as flax does.
    mixed = cls(64, epsilon=1e-5, dtype=jnp.bfloat16, promote_dtype=lambda a, **k: a, rngs=nnx.Rngs(0))
    assert_bitwise_equal(mixed(x.astype(jnp.float32)), fn(x.astype(jnp.float32), mixed).astype(jnp.bfloat16))


@pytest.mark.parametrize("center", [True, False])
def test_masked_and_multi_axis_norms_are_row_invariant_with_canonical_parameter_gradients(center):
    cls, flax_cls = (jnnx.LayerNorm, nnx.LayerNorm) if center else (jnnx.RMSNorm, nnx.RMSNorm)
    ours, theirs = cls(16, rngs=nnx.Rngs(0)), flax_cls(16, rngs=nnx.Rngs(0))
    nnx.update(ours, jax.tree.map(lambda p: p + normal(5, p.shape), nnx.state(ours)))
    nnx.update(theirs, nnx.state(ours))
    x = normal(1, (6, 16)) * 2 + 0.5
    mask = jax.random.bernoulli(jax.random.key(2), 0.7, (6, 16)).at[:, 0].set(True)
    g = normal(3, (6, 16))

    def loss(m, x, mask, g):
        return jnp.vdot(m(x, mask=mask), g)

    out = ours(x, mask=mask)
    dx = jax.grad(lambda x: loss(ours, x, mask, g))(x)
    assert rel_err(out, theirs(x, mask=mask)) < 1e-6
    assert rel_err(dx, jax.grad(lambda x: loss(theirs, x, mask, g))(x)) < 1e-6
    ours_g, theirs_g = nnx.grad(loss)(ours, x, mask, g), nnx.grad(loss)(theirs, x, mask, g)
    for name in ("scale", "bias") if center else ("scale",):
        assert rel_err(getattr(ours_g, name)[...], getattr(theirs_g, name)[...]) < 1e-5
    # The bits: a row alone, jit or eager (the products are rounded before they are added).
    jitted = nnx.jit(lambda m, x, mask: (m(x, mask=mask), jax.grad(lambda x: loss(m, x, mask, g))(x)))
    assert_bitwise_equal(jitted(ours, x, mask), (out, dx), "jit vs eager")
    for r in (0, 4):
        one = slice(r, r + 1)
        assert_bitwise_equal(ours(x[one], mask=mask[one]), out[one], "a masked row alone")
        assert_bitwise_equal(jax.grad(lambda x: loss(ours, x, mask[one], g[one]))(x[one]), dx[one], "its dx alone")
    assert_bitwise_equal(
        nnx.grad(loss)(ours, x, mask, g).scale[...],
        jaxdet.sum(g * _xhat_of(ours, x, mask, center), axis=0),
        "dscale: jaxdet.sum of g * xhat over the tokens",
    )
    step = jax.grad(lambda x, mask: jaxdet.sum(ours(x, mask=mask) ** 2))
    report = jaxdet.audit(step, x, mask, batch_argnums=(0, 1), strict=True)
    assert report.ok and not report.findings, str(report)
    # Statistics over the last two axes, scale over the last one.
    wide = cls(16, reduction_axes=(-2, -1), feature_axes=-1, rngs=nnx.Rngs(0))
    flax_wide = flax_cls(16, reduction_axes=(-2, -1), feature_axes=-1, rngs=nnx.Rngs(0))
    x3 = normal(4, (3, 4, 16))
    assert rel_err(wide(x3), flax_wide(x3)) < 1e-6
    assert_bitwise_equal(wide(x3[1:2]), wide(x3)[1:2], "an example alone")
    with pytest.raises(NotImplementedError, match="axis_name"):
        cls(16, axis_name="data", rngs=nnx.Rngs(0))(x)


def _xhat_of(norm, x, mask, center):
    """The normalized x of a scale-only view of `norm` (its scale set to ones, no bias)."""
    plain = type(norm)(x.shape[-1], rngs=nnx.Rngs(0), **({"use_bias": False} if center else {}))
    return plain(x, mask=mask)


# ---- Dropout. ----


def test_dropout_is_jaxdet_dropout_keyed_from_the_rngs_stream():
    layer = jnnx.Dropout(0.3, rngs=nnx.Rngs(dropout=7))
    stream = nnx.Rngs(dropout=7).fork()
    x = normal(0, (4, 6, 8))
    for _ in range(2):  # each call draws the stream's next key
        key = jaxdet.random.from_jax_key(stream.dropout())
        assert_bitwise_equal(layer(x), jaxdet.dropout(x, key, 0.3), "the Philox mask of the stream's key")
    assert_bitwise_equal(layer(x, deterministic=True), x)
    layer.eval()
    assert_bitwise_equal(layer(x), x)


@pytest.mark.parametrize("broadcast_dims", [(), (1,), (0,)])
def test_dropout_example_offset_gives_a_micro_batch_its_rows_of_the_whole_mask(broadcast_dims):
    layer = jnnx.Dropout(0.5, broadcast_dims=broadcast_dims, deterministic=False)
    x = normal(0, (6, 5, 8))
    key = jax.random.key(3)
    whole = layer(x, rngs=key)
    for lo, hi in ((0, 2), (2, 3), (3, 6)):
        assert_bitwise_equal(layer(x[lo:hi], rngs=key, example_offset=lo), whole[lo:hi], f"examples {lo}:{hi}")

    @nnx.jit
    def scanned(layer, x):  # micro-batches of two, the offset traced
        def body(_, xi):
            xs, i = xi
            return None, layer(xs, rngs=key, example_offset=2 * i)

        return jax.lax.scan(body, None, (x.reshape(3, 2, 5, 8), jnp.arange(3)))[1].reshape(x.shape)

    assert_bitwise_equal(scanned(layer, x), whole, "scanned micro-batches with traced offsets")


def test_dropout_example_offset_traced_past_int32_and_bad_values():
    layer = jnnx.Dropout(0.5, deterministic=False)
    x = normal(0, (2, 64, 64))  # 4096 mask elements per example
    key = jax.random.key(1)
    far = 600_000  # 600000 * 4096 > 2**31: an int32 product would wrap negative
    traced = jax.jit(lambda i: layer(x, rngs=key, example_offset=i))(jnp.int32(far))
    assert_bitwise_equal(traced, layer(x, rngs=key, example_offset=far), "traced int32 vs static offset")
    with pytest.raises(ValueError, match="example_offset"):
        layer(x, rngs=key, example_offset=-1)
    with pytest.raises(TypeError, match="example_offset"):
        layer(x, rngs=key, example_offset=jnp.zeros((2,), jnp.int32))


def test_dropout_in_an_nnx_jit_train_step_and_rate_one():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = jnnx.Linear(8, 8, rngs=rngs)
            self.drop = jnnx.Dropout(0.25, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.linear(x))

    model = Model(nnx.Rngs(0, dropout=1))
    x = normal(0, (4, 8))

    @nnx.jit
    def grads(model, x):
        return nnx.grad(lambda m: jaxdet.sum(m(x) ** 2))(model)

    g1, g2 = grads(model, x), grads(model, x)  # the stream advances: two different masks
    assert not np.array_equal(np.asarray(g1.linear.kernel[...]), np.asarray(g2.linear.kernel[...]))
    ones = jnp.ones((3, 4))
    assert_bitwise_equal(jnnx.Dropout(1.0, deterministic=False)(ones, rngs=jax.random.key(0)), jnp.zeros((3, 4)))


# ---- A model of drop-ins: the audit finds nothing. ----


def test_a_model_of_drop_ins_is_clean_under_the_audit():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = jnnx.Embed(50, 16, rngs=rngs)
            self.norm = jnnx.LayerNorm(16, rngs=rngs)
            self.linear = jnnx.Linear(16, 16, rngs=rngs)
            self.rms = jnnx.RMSNorm(16, rngs=rngs)
            self.drop = jnnx.Dropout(0.1, deterministic=False)
            self.out = jnnx.Linear(16, 4, rngs=rngs)

        def __call__(self, t, first_example):
            h = self.linear(self.norm(self.embed(t)))
            h = self.drop(h, rngs=jax.random.key(0), example_offset=first_example)
            return self.out(self.rms(jax.nn.gelu(h)))

    model = Model(nnx.Rngs(0))

    def step(model, t, first_example):
        grads = nnx.grad(lambda m: jaxdet.sum(m(t, first_example) ** 2))(model)
        return nnx.state(grads)

    report = jaxdet.audit(step, model, jnp.ones((4, 6), jnp.int32), jnp.int32(0), batch_argnums=1, strict=True)
    assert report.ok and not report.findings, str(report)


# ---- dot_product_attention as nnx.MultiHeadAttention's attention_fn. ----

D_MODEL, HEADS = 128, 2  # head dim 64


def mha(attention_fn, dot_general=None, *, num_kv_heads=None, decode=False, dtype=jnp.float32, **kw):
    return nnx.MultiHeadAttention(
        num_heads=HEADS,
        in_features=D_MODEL,
        num_kv_heads=num_kv_heads,
        decode=decode,
        use_bias=False,
        dtype=dtype,
        attention_fn=attention_fn,
        qkv_dot_general=dot_general,
        out_dot_general=dot_general,
        rngs=nnx.Rngs(0),
        **kw,
    )


def jaxdet_mha(**kw):
    return mha(jnnx.dot_product_attention, jnnx.dot_general, **kw)


def padding_mask(lengths, T):
    valid = jnp.arange(T)[None, :] < jnp.asarray(lengths)[:, None]
    return nnx.make_attention_mask(valid, valid)


@pytest.mark.parametrize("num_kv_heads", [None, 1], ids=["mha", "gqa"])
def test_attention_fn_is_flaxs_for_every_mask_nnx_builds(num_kv_heads):
    ours = jaxdet_mha(num_kv_heads=num_kv_heads)
    theirs = mha(nnx.dot_product_attention, num_kv_heads=num_kv_heads)
    nnx.update(theirs, nnx.state(ours))
    x = normal(1, (3, 12, D_MODEL))
    causal = nnx.make_causal_mask(jnp.ones((3, 12)))
    masks = {
        "causal": dict(mask=causal),
        "is_causal": dict(is_causal=True),
        "padding": dict(mask=padding_mask([12, 7, 1], 12)),
        "causal and padding": dict(mask=nnx.combine_masks(causal, padding_mask([12, 7, 1], 12))),
        "a [T, S] mask": dict(mask=jnp.tril(jnp.ones((12, 12), bool))),
        "none": dict(),
    }
    valid = np.arange(12)[None, :] < np.array([12, 7, 1])[:, None]
    for name, kw in masks.items():
        a, b = ours(x, **kw), theirs(x, **kw)
        rows = valid if "padding" in name else np.ones_like(valid)  # padding queries see nothing
        assert rel_err(np.asarray(a)[rows], np.asarray(b)[rows]) < 2e-6, name
    # Several batch dims: [2, 3, T, F].
    x4 = normal(2, (2, 3, 12, D_MODEL))
    assert rel_err(ours(x4, is_causal=True), theirs(x4, is_causal=True)) < 2e-6
    # Gradients through the mask, under nnx.jit.
    g = normal(3, (3, 12, D_MODEL))
    grads = nnx.jit(nnx.grad(lambda m, x: jnp.vdot(m(x, mask=causal), g)))
    ours_g, theirs_g = grads(ours, x), grads(theirs, x)
    for a, b in zip(jax.tree.leaves(nnx.state(ours_g)), jax.tree.leaves(nnx.state(theirs_g))):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_mode_gives_the_prefills_bits(dtype):
    prefill = jaxdet_mha(dtype=dtype)
    decoder = jaxdet_mha(decode=True, dtype=dtype)
    nnx.update(decoder, nnx.state(prefill, nnx.Param))
    x = normal(1, (2, 9, D_MODEL), dtype)
    want = prefill(x, mask=nnx.make_causal_mask(jnp.ones((2, 9))))
    decoder.init_cache((2, 16, D_MODEL), dtype)  # a full-length cache, masked past the current index
    step = nnx.jit(lambda m, xt: m(xt))
    got = jnp.concatenate([step(decoder, x[:, t : t + 1]) for t in range(9)], axis=1)
    assert_bitwise_equal(got, want, "nnx's decode loop vs the prefill")


def test_left_padded_rows_have_the_unpadded_bits():
    layer = jaxdet_mha()
    x = normal(1, (1, 7, D_MODEL))
    alone = layer(x, is_causal=True)
    padded = jnp.concatenate([normal(2, (1, 3, D_MODEL)), x], axis=1)  # 3 pad tokens on the left
    valid = jnp.arange(10)[None] >= 3
    mask = nnx.combine_masks(nnx.make_causal_mask(jnp.ones((1, 10))), nnx.make_attention_mask(valid, valid))
    assert_bitwise_equal(layer(padded, mask=mask)[:, 3:], alone, "left padding")


def test_attention_fn_refuses_what_it_cannot_do():
    x = normal(1, (2, 6, D_MODEL))
    with pytest.raises(NotImplementedError, match="dropout"):
        jaxdet_mha(dropout_rate=0.1)(x, deterministic=False, rngs=nnx.Rngs(dropout=0))
    assert jaxdet_mha(dropout_rate=0.1)(x, deterministic=True).shape == x.shape
    with pytest.raises(NotImplementedError, match="sow_weights"):
        jaxdet_mha()(x, sow_weights=True)
    q = normal(2, (2, 6, 2, 64))
    with pytest.raises(NotImplementedError, match="bias"):
        jnnx.dot_product_attention(q, q, q, bias=jnp.zeros((2, 2, 6, 6)))
    holes = np.ones((6, 6), bool)
    holes[3, 1] = False  # query 3 sees keys 0, 2..5: not one run
    with pytest.raises(ValueError, match="contiguous"):
        jnnx.dot_product_attention(q, q, q, mask=holes)
    with pytest.raises(ValueError, match="broadcastable"):
        jnnx.dot_product_attention(q, q, q, mask=np.ones((5, 6), bool))


# ---- GPU. ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_decode_mode_gives_the_prefills_bits(on_gpu, dtype):
    test_decode_mode_gives_the_prefills_bits(dtype)


@pytest.mark.gpu
def test_gpu_drop_ins_row_invariant_and_dropout_equal_to_the_cpu(on_gpu):
    test_linear_is_flaxs_to_rounding_and_row_invariant(jnp.bfloat16)
    test_left_padded_rows_have_the_unpadded_bits()
    layer = jnnx.Dropout(0.3, deterministic=False)
    x = normal(0, (4, 6, 8), jnp.bfloat16)
    on_gpu_bits = layer(x, rngs=jax.random.key(1), example_offset=3)
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        on_cpu_bits = layer(jax.device_put(x, cpu), rngs=jax.device_put(jax.random.key(1), cpu), example_offset=3)
    assert_bitwise_equal(np.asarray(on_gpu_bits), np.asarray(on_cpu_bits), "the same mask on GPU and CPU")
