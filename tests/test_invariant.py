"""jaxdet.invariant: a user's plain JAX function, made batch-invariant, deterministic and
device-count invariant (docs/invariant.md)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from multidevice import on_devices

import jaxdet
from jaxdet.models import plain_llama as L
from jaxdet.testing import assert_bitwise_equal

invariant = jaxdet.invariant
Unsupported = jaxdet.invariant.UnsupportedPrimitiveError


def _normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# ---- Products: dot_general with any dimension numbers ----


def _np_dot_general(a, b, dn):
    """The float64 NumPy reference of lax.dot_general (output: batch, lhs free, rhs free)."""
    (lc, rc), (lb, rb) = dn
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    la, lb_ = [None] * a.ndim, [None] * b.ndim
    for i, j in zip(lb, rb):
        la[i] = lb_[j] = next(letters)
    for i, j in zip(lc, rc):
        la[i] = lb_[j] = next(letters)
    for arr in (la, lb_):
        for i, v in enumerate(arr):
            if v is None:
                arr[i] = next(letters)
    out = [la[i] for i in lb] + [la[i] for i in range(a.ndim) if i not in lb + lc]
    out += [lb_[i] for i in range(b.ndim) if i not in rb + rc]
    spec = f"{''.join(la)},{''.join(lb_)}->{''.join(out)}"
    return np.einsum(spec, np.asarray(a, np.float64), np.asarray(b, np.float64))


DOT_CASES = [
    # (lhs shape, rhs shape, ((lc, rc), (lb, rb)))
    ((6, 16), (16, 8), (((1,), (0,)), ((), ()))),  # x @ w
    ((6, 16), (8, 16), (((1,), (1,)), ((), ()))),  # x @ w.T (read transposed)
    ((16, 6), (16, 8), (((0,), (0,)), ((), ()))),  # dW: tokens contracted
    ((16, 6), (8, 16), (((0,), (1,)), ((), ()))),  # a transposed copy
    ((2, 3, 5, 16), (16, 7), (((3,), (0,)), ((), ()))),  # rows of every leading dim
    ((2, 4, 5, 8), (2, 4, 6, 8), (((3,), (3,)), ((0, 1), (0, 1)))),  # attention scores
    ((2, 4, 5, 6), (2, 4, 6, 8), (((3,), (2,)), ((0, 1), (0, 1)))),  # attention values
    ((2, 3, 16), (2, 3, 8), (((0, 1), (0, 1)), ((), ()))),  # dW over batch and sequence
    ((3, 4, 5), (5, 4, 2), (((1, 2), (1, 0)), ((), ()))),  # two contracted dims, permuted
    ((4, 3), (5, 2), (((), ()), ((), ()))),  # outer product
    ((2, 9000), (9000, 3), (((1,), (0,)), ((), ()))),  # K beyond one chunk: the tree
]


@pytest.mark.parametrize("case", range(len(DOT_CASES)))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dot_general_any_dimension_numbers(case, dtype):
    ls, rs, dn = DOT_CASES[case]
    a, b = _normal(1, ls, dtype), _normal(2, rs, dtype)

    def f(a, b):
        return lax.dot_general(a, b, dn, preferred_element_type=jnp.float32)

    got = jax.jit(invariant(f))(a, b)
    want = _np_dot_general(a, b, dn)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert _rel_err(got, want) < 1e-5  # float32 accumulation over K up to 9000


def test_dot_general_rows_alone_equal_rows_in_batch():
    w = _normal(3, (64, 48))
    x = _normal(4, (37, 64))

    def f(x):
        return jnp.tanh(x @ w) @ w.T

    full = jax.jit(invariant(f))(x)
    for n in (1, 5, 16):
        assert_bitwise_equal(jax.jit(invariant(f))(x[:n]), full[:n])


def test_dot_general_chunk_tree_beyond_one_chunk():
    """K = 2.5 chunks: the chunk partials meet in the canonical tree; zeros appended to K (a
    longer KV cache, padding tokens) change no bit."""
    c = jaxdet.invariant.CHUNK_TOKENS
    K = 2 * c + c // 2
    a, b = _normal(5, (3, K)), _normal(6, (K, 4))
    f = invariant(lambda a, b: a @ b)
    got = jax.jit(f)(a, b)
    pad = 3 * c + 7
    padded = jax.jit(f)(jnp.pad(a, ((0, 0), (0, pad - K))), jnp.pad(b, ((0, pad - K), (0, 0))))
    assert_bitwise_equal(padded, got)


def _weight_gradient_written_transposed(dtype, device):
    """JAX's gradient of ``x @ w`` in ``w`` is ``transpose(g^T x)``: the transformation computes
    ``x^T g`` instead, which writes the transposed result directly, with the same bits."""
    from jaxdet._src.matmul.dot_general import dot_general

    dn = (((0, 1), (0, 1)), ((), ()))
    with jax.default_device(jax.devices(device)[0]):
        for T in (300, 9000):  # one chunk, and chunk partials in the tree
            x = _normal(50, (2, T, 64), dtype)
            g = _normal(51, (2, T, 48), dtype)
            h = jax.jit(invariant(lambda x, g: lax.dot_general(g, x, dn).T))
            assert "transpose" not in h.lower(x, g).as_text()
            assert_bitwise_equal(h(x, g), dot_general(g, x, dn).T)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_weight_gradient_written_transposed_keeps_the_bits(dtype):
    _weight_gradient_written_transposed(dtype, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"])
def test_gpu_weight_gradient_written_transposed_keeps_the_bits(dtype, on_gpu):
    _weight_gradient_written_transposed(dtype, "gpu")


def test_integer_products_and_sums_are_exact():
    a = jnp.arange(12, dtype=jnp.int32).reshape(3, 4)
    f = invariant(lambda a: (a @ a.T).sum(axis=1) + jnp.cumsum(a, axis=1)[:, -1])
    np.testing.assert_array_equal(jax.jit(f)(a), (a @ a.T).sum(axis=1) + jnp.cumsum(a, axis=1)[:, -1])


# ---- Max and min ----


def test_max_min_nan_and_signed_zero():
    x = jnp.array([[0.0, -0.0, -1.0], [-0.0, -0.0, -2.0], [1.0, jnp.nan, 2.0], [-jnp.inf, -5.0, -jnp.inf]])
    mx = jax.jit(invariant(lambda x: jnp.max(x, axis=1)))(x)
    mn = jax.jit(invariant(lambda x: jnp.min(x, axis=1)))(x)
    bits = lambda v: np.asarray(v).view(np.uint32)  # noqa: E731
    # +0 > -0; a NaN anywhere gives the canonical quiet NaN.
    np.testing.assert_array_equal(bits(mx), bits(jnp.array([0.0, -0.0, jnp.nan, -5.0])))
    np.testing.assert_array_equal(bits(mn), bits(jnp.array([-1.0, -2.0, jnp.nan, -jnp.inf])))
    assert bits(mx)[2] == 0x7FC00000 and bits(mn)[2] == 0x7FC00000
    am = jax.jit(invariant(lambda x: jnp.argmax(x, axis=1)))(x)
    np.testing.assert_array_equal(am, jnp.argmax(x, axis=1))


def test_max_min_bfloat16_and_cumulative():
    x = _normal(7, (4, 33), jnp.bfloat16)
    np.testing.assert_array_equal(jax.jit(invariant(lambda x: x.max(axis=0)))(x), x.max(axis=0))
    np.testing.assert_array_equal(jax.jit(invariant(lambda x: lax.cummax(x, axis=1)))(x), lax.cummax(x, axis=1))


# ---- Programs inside programs ----


def test_recursion_into_jit_scan_while_cond_remat_custom_rules():
    w = _normal(8, (16, 16))

    @jax.custom_jvp
    def softsign(x):
        return x / (1 + jnp.abs(x))

    softsign.defjvp(lambda p, t: (softsign(p[0]), t[0] / (1 + jnp.abs(p[0])) ** 2))

    @jax.custom_vjp
    def scaled(x):
        return 2.0 * x

    scaled.defvjp(lambda x: (2.0 * x, None), lambda _, g: (2.0 * g,))

    def f(x, loop=True):
        y = jax.jit(lambda a: a @ w)(x)
        y = lax.scan(lambda c, r: (c, jnp.tanh(r @ w)), 0.0, y)[1]
        if loop:  # (while_loop has no reverse-mode derivative in JAX)
            y = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.sin(c[1] @ w)), (0, y))[1]
        y = lax.cond(x[0, 0] > 0, lambda a: a @ w, lambda a: -(a @ w), y)
        y = jax.checkpoint(lambda a: jnp.exp(a @ w))(y)
        return scaled(softsign(y))

    x = _normal(9, (6, 16))
    got = jax.jit(invariant(f))(x)
    assert _rel_err(got, f(x)) < 1e-5
    for n in (1, 3):
        assert_bitwise_equal(jax.jit(invariant(f))(x[:n]), got[:n])

    def sq(x):
        y = f(x, loop=False)
        return jnp.vdot(y, y)

    assert _rel_err(jax.jit(jax.grad(invariant(sq)))(x), jax.grad(sq)(x)) < 1e-4


def test_jaxdet_primitives_pass_through():
    x = _normal(10, (4, 32))
    w = _normal(11, (32, 8))
    f = lambda x: jaxdet.rms_norm(jaxdet.matmul(x, w), jnp.ones((8,)))  # noqa: E731
    assert_bitwise_equal(jax.jit(invariant(f))(x), jax.jit(f)(x))


# ---- Derivatives ----


def test_grad_of_invariant_equals_invariant_of_grad():
    w, v = _normal(12, (16, 32)), _normal(13, (32, 8))
    x = _normal(14, (3, 5, 16))

    def loss(w, v, x):
        y = jnp.einsum("bsd,de->bse", jnp.tanh(x @ w), v)
        return jnp.vdot(y, y)

    gi = jax.jit(jax.grad(invariant(loss), argnums=(0, 1)))(w, v, x)
    ig = jax.jit(invariant(jax.grad(loss, argnums=(0, 1))))(w, v, x)
    want = jax.grad(loss, argnums=(0, 1))(w, v, x)
    for a, b, c in zip(gi, ig, want):
        assert_bitwise_equal(a, b)
        assert _rel_err(a, c) < 1e-5


def test_closed_over_values_are_differentiated():
    w = _normal(15, (8, 8))
    x = _normal(16, (4, 8))

    def outer(w):
        return invariant(lambda x: jnp.vdot(x @ w, x @ w))(x)

    assert _rel_err(jax.grad(outer)(w), jax.grad(lambda w: jnp.vdot(x @ w, x @ w))(w)) < 1e-5


def test_vmap_of_invariant():
    w = _normal(17, (16, 8))
    x = _normal(18, (5, 3, 16))
    f = invariant(lambda x: jnp.tanh(x @ w))
    got = jax.jit(jax.vmap(f))(x)
    assert_bitwise_equal(got[2], jax.jit(f)(x[2]))


# ---- What is refused ----


@pytest.mark.parametrize(
    "fn, name",
    [
        (lambda x: jax.random.normal(jax.random.key(0), x.shape) * x, "random_bits"),
        (lambda x: jnp.sort(x, axis=-1), "sort"),
        (lambda x: jnp.cumsum(x, axis=-1), "cumsum"),
        (lambda x: jnp.prod(x, axis=-1), "reduce_prod"),
        (
            lambda x: lax.conv_general_dilated(x[None, None], jnp.ones((1, 1, 3, 3)), (1, 1), "SAME")[0, 0],
            "conv_general_dilated",
        ),
    ],
)
def test_unsupported_operations_raise_naming_the_operation_and_line(fn, name):
    x = _normal(19, (4, 8))
    with pytest.raises(Unsupported, match=name) as info:
        jax.jit(invariant(fn))(x)
    assert "test_invariant.py" in str(info.value)


def test_bad_arguments():
    with pytest.raises(TypeError, match="callable"):
        invariant(3)
    with pytest.raises(TypeError, match="functools.partial"):
        invariant(lambda x, s: x)(jnp.ones(3), "mode")


# ---- Sums, scatter-adds ----


@pytest.mark.parametrize("axes", [(1,), (0,), (0, 1), (2,), (0, 2), None])
def test_reduce_sum_any_axes(axes):
    x = _normal(20, (5, 6, 7), jnp.bfloat16)
    f = invariant(lambda x: jnp.sum(x, axis=axes, dtype=jnp.float32))
    got = jax.jit(f)(x)
    assert_bitwise_equal(got, jaxdet.sum(x, axis=axes, dtype=jnp.float32))
    assert _rel_err(got, np.sum(np.asarray(x, np.float64), axis=axes)) < 1e-6


def test_embedding_gradient_is_the_segment_sum():
    table = _normal(21, (11, 8))
    ids = jnp.array([[1, 3, 1, 7], [3, 3, 0, 10]])
    g = _normal(22, (2, 4, 8))

    def f(table):
        return jnp.vdot(jnp.take(table, ids, axis=0), g)

    got = jax.jit(jax.grad(invariant(f)))(table)
    assert_bitwise_equal(got, jaxdet.segment_sum(g.reshape(-1, 8), ids.reshape(-1), 11))


# ---- The model: a Llama-style decoder in plain JAX (jaxdet.models.plain_llama) ----

CFG = {jnp.float32: L.Config(), jnp.bfloat16: L.Config(dtype=jnp.bfloat16)}


def _batch(cfg, key, B, T):
    tokens = jax.random.randint(jax.random.key(key), (B, T + 1), 0, cfg.vocab)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.fixture(scope="module", params=[jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def model(request):
    cfg = CFG[request.param]
    return cfg, L.init(cfg, jax.random.key(0))


def test_model_log_probs_rows_alone_equal_rows_in_batches(model):
    cfg, params = model
    tokens, targets = _batch(cfg, 1, 8, 16)
    lp = jax.jit(invariant(functools.partial(L.log_probs, cfg)))
    full = lp(params, tokens, targets)
    assert_bitwise_equal(lp(params, tokens[3:4], targets[3:4]), full[3:4])
    perm = jnp.array([5, 2, 7, 0])
    assert_bitwise_equal(lp(params, tokens[perm], targets[perm]), full[perm])
    plain = L.log_probs(cfg, params, tokens, targets)
    assert _rel_err(full, plain) < (1e-5 if cfg.dtype == jnp.float32 else 2e-2)


def test_model_input_gradient_rows_alone_equal_rows_in_batches(model):
    cfg, params = model
    tokens, targets = _batch(cfg, 2, 6, 12)
    x = L.embed(params, tokens)

    def total(x, tokens, targets):
        return jnp.sum(L.log_probs(cfg, params, tokens, targets, embeddings=x))

    grad = jax.jit(jax.grad(invariant(total)))
    full = grad(x, tokens, targets)
    assert_bitwise_equal(grad(x[4:5], tokens[4:5], targets[4:5]), full[4:5])
    assert_bitwise_equal(grad(x[1:3], tokens[1:3], targets[1:3]), full[1:3])


def test_model_decode_over_a_masked_full_length_cache_equals_the_one_pass_forward(model):
    cfg, params = model
    B, T = 3, 10
    tokens, _ = _batch(cfg, 3, B, T)
    logits = jax.jit(invariant(functools.partial(L.forward, cfg)))(params, tokens)
    step = jax.jit(invariant(functools.partial(L.decode_step, cfg)))
    cache = L.init_cache(cfg, B)
    for t in range(T):
        out, cache = step(params, cache, tokens[:, t], t)
        assert_bitwise_equal(out, logits[:, t])


def test_model_micro_batches_of_whole_chunks_reproduce_the_full_batch():
    """Two and four micro-batches of one chunk of tokens each, their gradients combined by the
    canonical tree, give the full batch's gradient bits (mean losses: the micro-batch gradients
    are averaged, exact in powers of two)."""
    cfg = L.Config(d_model=32, n_heads=2, n_kv_heads=1, d_ff=32, n_layers=1, vocab=61)
    params = L.init(cfg, jax.random.key(1))
    c = jaxdet.invariant.CHUNK_TOKENS
    T = 32
    tokens, targets = _batch(cfg, 4, 4 * c // T, T)
    grad = jax.jit(jax.grad(invariant(functools.partial(L.loss, cfg=cfg))))
    full = grad(params, tokens, targets)
    for n in (2, 4):
        rows = tokens.shape[0] // n
        parts = [grad(params, tokens[i * rows : (i + 1) * rows], targets[i * rows : (i + 1) * rows]) for i in range(n)]
        combined = jax.tree.map(lambda *g: g[0] / n, jaxdet.parallel.tree_sum(parts))
        jax.tree.map(assert_bitwise_equal, combined, full)


def test_model_two_runs_same_bits(model):
    cfg, params = model
    tokens, targets = _batch(cfg, 5, 4, 16)
    step = jax.jit(jax.value_and_grad(invariant(functools.partial(L.loss, cfg=cfg))))
    first = step(params, tokens, targets)
    jax.tree.map(assert_bitwise_equal, step(params, tokens, targets), first)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_elementwise_bits_do_not_depend_on_fusion_or_jit(dtype):
    """The issue's measurement: gelu(x) + y fused in one program, as two programs, and eager (op by
    op, no fusion) give the same bits under the transformation; so do an eager sampler's and a
    jitted trainer's log-probs."""
    x, y = _normal(40, (4096,), dtype), _normal(41, (4096,), dtype)
    fused = jax.jit(invariant(lambda x, y: jax.nn.gelu(x) + y))(x, y)
    apart = jax.jit(invariant(lambda a, y: a + y))(jax.jit(invariant(jax.nn.gelu))(x), y)
    eager = invariant(lambda x, y: jax.nn.gelu(x) + y)(x, y)
    assert_bitwise_equal(apart, fused)
    assert_bitwise_equal(eager, fused)
    cfg = CFG[dtype]
    params = L.init(cfg, jax.random.key(0))
    tokens, targets = _batch(cfg, 7, 3, 8)
    lp = invariant(functools.partial(L.log_probs, cfg))
    assert_bitwise_equal(lp(params, tokens, targets), jax.jit(lp)(params, tokens, targets))


def test_audit_of_the_transformed_step_finds_nothing():
    cfg, params = CFG[jnp.float32], L.init(CFG[jnp.float32], jax.random.key(0))
    tokens, targets = _batch(cfg, 6, 2, 8)
    loss = functools.partial(L.loss, cfg=cfg)
    assert not jaxdet.audit(loss, params, tokens, targets, batch_argnums=(1, 2)).ok  # the plain step
    for step in (jax.grad(invariant(loss)), invariant(jax.grad(loss))):
        report = jaxdet.audit(step, params, tokens, targets, batch_argnums=(1, 2), strict=True)
        assert report.ok and not report.findings, str(report)


# ---- jax.nn.dot_product_attention on jaxdet's fused kernel (docs/invariant.md, "Attention") ----


def _qkv_heads(B, T, S, N, K, H, dtype=jnp.float32, seed=40):
    return (
        _normal(seed, (B, T, N, H), dtype),
        _normal(seed + 1, (B, S, K, H), dtype),
        _normal(seed + 2, (B, S, K, H), dtype),
    )


def _sdpa(*extra, **kw):
    """jax.nn.dot_product_attention with these arguments; per-sequence lengths are the last B of
    the given ones, so the call on a batch's last rows is the same call on those rows."""

    def call(q, k, v):
        B = q.shape[0]
        lengths = {n: x[-B:] for n, x in kw.items() if n.endswith("seq_lengths")}
        return jax.nn.dot_product_attention(q, k, v, *extra, **{**kw, **lengths})

    return call


ATTENTION_FORMS = {
    "causal": _sdpa(is_causal=True),
    "mask": _sdpa(None, jnp.tril(jnp.ones((1, 1, 24, 24), bool))),
    "padding": _sdpa(is_causal=True, key_value_seq_lengths=jnp.array([24, 9], jnp.int32)),
    "query padding": _sdpa(query_seq_lengths=jnp.array([7, 24], jnp.int32)),
    "window": _sdpa(is_causal=True, local_window_size=(5, 0)),
    "not causal": _sdpa(),
}


@pytest.mark.parametrize("form", list(ATTENTION_FORMS))
def test_attention_calls_run_on_the_fused_kernel(form):
    """Every form of the call runs on jaxdet.attention, matching JAX's XLA implementation."""
    fn = ATTENTION_FORMS[form]
    q, k, v = _qkv_heads(2, 24, 24, 4, 2, 64)
    f = jax.jit(invariant(fn))
    assert "jaxdet_attention_fwd" in f.lower(q, k, v).as_text()
    got = f(q, k, v)
    assert _rel_err(got, fn(q, k, v)) < 1e-5
    assert_bitwise_equal(f(q[1:], k[1:], v[1:]), got[1:])


def test_attention_prefill_and_masked_cache_decode_take_one_path():
    """`is_causal=True` over the prompt and single-query steps over a full-length cache with a
    mask (and over left padding) give the same bits: one kernel, one order from the first key."""
    T, S = 12, 32
    q, k, v = _qkv_heads(2, T, T, 4, 1, 64, jnp.bfloat16)
    prefill = jax.jit(invariant(_sdpa(is_causal=True)))(q, k, v)
    pad = lambda x: jnp.concatenate([x, jnp.zeros((2, S - T) + x.shape[2:], x.dtype)], 1)  # noqa: E731
    decode = jax.jit(invariant(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m)))
    for t in range(T):
        mask = (jnp.arange(S) <= t)[None, None, None, :]
        assert_bitwise_equal(decode(q[:, t : t + 1], pad(k), pad(v), mask), prefill[:, t : t + 1])
    shift = lambda x: jnp.concatenate([jnp.ones((2, 3) + x.shape[2:], x.dtype), x], 1)  # noqa: E731
    left = (jnp.arange(T + 3) >= 3)[None, None, None, :]
    padded = jax.jit(invariant(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True)))
    assert_bitwise_equal(padded(shift(q), shift(k), shift(v), left)[:, 3:], prefill)


def test_attention_forms_without_a_fused_kernel_follow_the_rules():
    """A bias, a head dimension the kernel lacks, or residuals: JAX's XLA implementation,
    evaluated by the rules (rows still invariant)."""
    q, k, v = _qkv_heads(3, 16, 16, 4, 2, 16)
    f = jax.jit(invariant(_sdpa(is_causal=True)))
    assert "jaxdet_attention_fwd" not in f.lower(q, k, v).as_text()
    assert_bitwise_equal(f(q[2:], k[2:], v[2:]), f(q, k, v)[2:])
    q, k, v = _qkv_heads(3, 16, 16, 4, 2, 64)
    bias = _normal(3, (1, 4, 16, 16))
    g = jax.jit(invariant(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias)))
    assert "jaxdet_attention_fwd" not in g.lower(q, k, v).as_text()
    assert_bitwise_equal(g(q[:1], k[:1], v[:1]), g(q, k, v)[:1])
    assert _rel_err(g(q, k, v), jax.nn.dot_product_attention(q, k, v, bias)) < 1e-5


def test_attention_model_with_a_fused_head_dimension():
    """The plain-JAX Llama at head dimension 64: rows alone == in batches, decode over the
    masked full-length cache == the one-pass forward, with the fused kernel in the program."""
    cfg = L.Config(d_model=128, n_heads=2, n_kv_heads=1, dtype=jnp.bfloat16)
    params = L.init(cfg, jax.random.key(0))
    tokens, targets = _batch(cfg, 5, 4, 10)
    lp = jax.jit(invariant(functools.partial(L.log_probs, cfg)))
    assert "jaxdet_attention_fwd" in lp.lower(params, tokens, targets).as_text()
    full = lp(params, tokens, targets)
    assert_bitwise_equal(lp(params, tokens[2:3], targets[2:3]), full[2:3])
    logits = jax.jit(invariant(functools.partial(L.forward, cfg)))(params, tokens)
    step = jax.jit(invariant(functools.partial(L.decode_step, cfg)))
    cache = L.init_cache(cfg, 4)
    for t in range(10):
        out, cache = step(params, cache, tokens[:, t], t)
        assert_bitwise_equal(out, logits[:, t])
    grads = jax.jit(jax.grad(invariant(functools.partial(L.loss, cfg=cfg))))
    jax.tree.map(assert_bitwise_equal, grads(params, tokens, targets), grads(params, tokens, targets))


# ---- On the GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_model_rows_decode_and_runs(dtype, on_gpu):
    """The plain-JAX model on the GPU: rows alone == rows in batches, decode over the masked
    full-length cache == the one-pass forward, two runs of the train step give the same bits."""
    cfg = CFG[dtype]
    params = L.init(cfg, jax.random.key(0))
    tokens, targets = _batch(cfg, 1, 8, 16)
    lp = jax.jit(invariant(functools.partial(L.log_probs, cfg)))
    full = lp(params, tokens, targets)
    assert_bitwise_equal(lp(params, tokens[3:4], targets[3:4]), full[3:4])
    logits = jax.jit(invariant(functools.partial(L.forward, cfg)))(params, tokens[:3])
    step = jax.jit(invariant(functools.partial(L.decode_step, cfg)))
    cache = L.init_cache(cfg, 3)
    for t in range(6):
        out, cache = step(params, cache, tokens[:3, t], t)
        assert_bitwise_equal(out, logits[:, t])
    train = jax.jit(jax.value_and_grad(invariant(functools.partial(L.loss, cfg=cfg))))
    first = train(params, tokens, targets)
    jax.tree.map(assert_bitwise_equal, train(params, tokens, targets), first)


@pytest.mark.gpu
def test_gpu_cudnn_attention_in_user_code_runs_on_jaxdet_attention(on_gpu):
    """`jax.nn.dot_product_attention(..., implementation="cudnn")` in the user's code: the cuDNN
    call never stays in the transformed program; jaxdet's fused kernel runs it, with the bits of
    the same call with implementation="xla" and of a masked decode step."""
    q = _normal(30, (4, 128, 8, 64), jnp.bfloat16)
    k = _normal(31, (4, 128, 2, 64), jnp.bfloat16)
    v = _normal(32, (4, 128, 2, 64), jnp.bfloat16)

    def attn(impl):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    cudnn = jax.jit(invariant(attn("cudnn")))
    text = cudnn.lower(q, k, v).as_text()
    assert "cudnn" not in text.lower() and "jaxdet_attention_fwd" in text
    full = cudnn(q, k, v)
    assert_bitwise_equal(full, jax.jit(invariant(attn("xla")))(q, k, v))
    assert_bitwise_equal(cudnn(q[:1], k[:1], v[:1]), full[:1])
    decode = jax.jit(
        invariant(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, implementation="cudnn"))
    )
    for t in (0, 63, 127):
        mask = (jnp.arange(128) <= t)[None, None, None, :]
        assert_bitwise_equal(decode(q[:, t : t + 1], k, v, mask), full[:, t : t + 1])
    assert _rel_err(full, jax.nn.dot_product_attention(q, k, v, is_causal=True)) < 2e-2


@pytest.mark.gpu
def test_gpu_cudnn_attention_bound_under_another_name_is_refused(on_gpu):
    from jax.nn import dot_product_attention as bound  # bound before the transformation

    q = _normal(30, (2, 128, 4, 64), jnp.bfloat16)
    f = invariant(lambda q: bound(q, q, q, is_causal=True, implementation="cudnn"))
    with pytest.raises(Unsupported, match="test_invariant.py"):
        jax.jit(f)(q)


@pytest.mark.gpu
def test_gpu_attention_model_with_a_fused_head_dimension(on_gpu):
    test_attention_model_with_a_fused_head_dimension()


__all__ = ["on_devices"]
