"""Forward mode and second derivatives (docs/derivatives.md): jax.jvp, jax.linearize, jax.jacfwd,
jax.hessian and grad of grad through matmul, dropout, the norms, the softmax family, jaxdet.sum and
jaxdet.attention (every row form), against float64 references by relative norm; tangent rows bitwise
independent of the batch (attention: of the batch, and a decode step's of the full pass; its tangent
in blocks of query positions has the one-block bits); the same bits under jit, vmap and remat
(inside shard_map and under sharded jit:
tests/test_rowops_sharding.py::test_tangents_in_shard_map_and_sharded_jit_equal_one_device and
::test_attention_tangents_in_shard_map_and_sharded_jit_equal_one_device).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise

import jaxdet

F32, F64 = jnp.float32, jnp.float64
LABELS = np.array([3, 0, 7, 5, 1, 6, 2, 4, 7, 0, 3, 1, 5, 2, 6, 4])
KEY = np.array([12345, 678], np.uint32)


def rand(shape, seed, dtype=F32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def _rms_ref(x, w, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def _layer_ref(x, w, b, eps=1e-6):
    xc = x - jnp.mean(x, -1, keepdims=True)
    return xc * jax.lax.rsqrt(jnp.mean(xc * xc, -1, keepdims=True) + eps) * w + b


def _xent_ref(x, sign):
    labels = LABELS[: x.shape[-2]] if x.ndim > 1 else LABELS[0]
    picked = jnp.take_along_axis(jax.nn.log_softmax(x), jnp.asarray(labels)[..., None], -1)[..., 0]
    return sign * picked


def _labels(x):
    return jnp.asarray(LABELS[: x.shape[-2]] if x.ndim > 1 else LABELS[0], jnp.int32)


def _dropout_ref(x):
    # Dropout is x times a fixed mask of 0 and 1/(1 - rate): the mask is jaxdet.dropout of ones.
    return x * jaxdet.dropout(jnp.ones(x.shape, F32), KEY, 0.5).astype(x.dtype)


def _attention_ref(q, k, v, visible, scale=None):
    """Attention of q [B, T, N, D] over k, v [B, S, K, D] with visible [B, T, S] (NumPy bool): a
    plain-JAX softmax over the visible keys (a row with none gives zeros)."""
    B, T, N, D = q.shape
    G = N // k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    vis = jnp.asarray(visible)[:, None]  # [B, 1, T, S]
    s = jnp.einsum("btnd,bsnd->bnts", q, jnp.repeat(k, G, axis=2)) * scale
    m = jax.lax.stop_gradient(jnp.max(jnp.where(vis, s, -jnp.inf), -1, keepdims=True))
    e = jnp.where(vis, jnp.exp(jnp.where(vis, s - jnp.where(jnp.isfinite(m), m, 0), 0)), 0)
    total = jnp.sum(e, -1, keepdims=True)
    p = e / jnp.where(total > 0, total, 1)
    return jnp.einsum("bnts,bsnd->btnd", p, jnp.repeat(v, G, axis=2))


def _causal(T, S, pos):
    return np.arange(S)[None, None, :] <= np.asarray(pos)[..., None]  # [B, T, S]


# Each row form of jaxdet.attention: (keyword arguments, visible [B, T, S], T, S). B = 2.
_POS = np.array([[3, 6], [1, 2]])  # a decode step's two queries per sequence, against a cache of 7
_KV_LEN = np.array([6, 2])  # sequence 1's second query (position 2) sees only its first two keys
_SEGMENTS = np.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 3, 3]])
_PAD = np.array([1, 4])  # left padding: sequence b's first key is b's pad (rows before it see none)
_SAME_SEGMENT = _SEGMENTS[:, :, None] == _SEGMENTS[:, None, :]
ATTENTION_FORMS = {
    "causal": ({}, _causal(6, 6, np.broadcast_to(np.arange(6), (2, 6))), 6, 6),
    # sequence 1 has no key: its rows' outputs and tangents are zeros
    "lengths": (
        dict(causal=False, kv_lengths=np.array([4, 0], np.int32)),
        np.broadcast_to(np.arange(6) < np.array([4, 0])[:, None, None], (2, 6, 6)),
        6,
        6,
    ),
    "decode": (
        dict(q_positions=_POS.astype(np.int32), kv_lengths=_KV_LEN.astype(np.int32)),
        _causal(2, 7, _POS) & (np.arange(7) < _KV_LEN[:, None, None]),
        2,
        7,
    ),
    "segments": (
        dict(segment_ids=_SEGMENTS.astype(np.int32)),
        _SAME_SEGMENT & _causal(6, 6, np.broadcast_to(np.arange(6), (2, 6))),
        6,
        6,
    ),
    "segments_bidirectional": (dict(causal=False, segment_ids=_SEGMENTS.astype(np.int32)), _SAME_SEGMENT, 6, 6),
    "mask": (
        dict(mask=(np.arange(6)[None, :] >= _PAD[:, None])[:, None, None, :]),
        (np.arange(6) >= _PAD[:, None, None]) & _causal(6, 6, np.broadcast_to(np.arange(6), (2, 6))),
        6,
        6,
    ),
    "window": (
        dict(window=3),
        _causal(6, 6, np.broadcast_to(np.arange(6), (2, 6))) & (np.arange(6) > np.arange(6)[:, None] - 3),
        6,
        6,
    ),
}


def _attention_case(form, D=32, N=2, K=1):
    """A CASES entry: jaxdet.attention in the row form, its float64 reference and (q, k, v)'s shapes
    (grouped-query heads: N = 2 query heads on K = 1 KV head)."""
    kwargs, visible, T, S = ATTENTION_FORMS[form]
    kwargs = {n: jnp.asarray(a) if isinstance(a, np.ndarray) else a for n, a in kwargs.items()}
    return (
        lambda q, k, v: jaxdet.attention(q, k, v, **kwargs),
        lambda q, k, v: _attention_ref(q, k, v, visible),
        [(2, T, N, D), (2, S, K, D), (2, S, K, D)],
    )


# name: (jaxdet function, float64 reference, arguments' shapes; the first is the row argument [R, n]).
CASES = {
    "matmul": (lambda a, b: jaxdet.matmul(a, b), lambda a, b: a @ b, [(6, 8), (8, 3)]),
    "matmul_batched": (lambda a, b: jaxdet.matmul(a, b), lambda a, b: a @ b, [(2, 3, 4), (2, 4, 3)]),
    "rms_norm": (lambda x, w: jaxdet.rms_norm(x, w), _rms_ref, [(6, 16), (16,)]),
    "layer_norm": (lambda x, w, b: jaxdet.layer_norm(x, w, b), _layer_ref, [(6, 16), (16,), (16,)]),
    "softmax": (jaxdet.softmax, jax.nn.softmax, [(6, 8)]),
    "log_softmax": (jaxdet.log_softmax, jax.nn.log_softmax, [(6, 8)]),
    "softmax_cross_entropy": (
        lambda x: jaxdet.softmax_cross_entropy(x, _labels(x)),
        lambda x: _xent_ref(x, -1.0),
        [(6, 8)],
    ),
    "label_log_probs": (lambda x: jaxdet.label_log_probs(x, _labels(x)), lambda x: _xent_ref(x, 1.0), [(6, 8)]),
    "dropout": (lambda x: jaxdet.dropout(x, KEY, 0.5), _dropout_ref, [(6, 8)]),
    "sum": (lambda x: jaxdet.sum(x, axis=-1), lambda x: jnp.sum(x, -1), [(6, 8)]),
    **{f"attention_{form}": _attention_case(form) for form in ATTENTION_FORMS},
    # a head dimension run on the 128 kernel with zero columns; multi-head (G = 1)
    "attention_d80": _attention_case("causal", D=80, N=1),
}
# Dropout's mask is indexed by the element's position in the array (docs/dropout.md), not by row;
# attention's rows are queries of sequences with their own keys (attention's own tests below).
ROW_OPS = [n for n in CASES if n not in ("matmul_batched", "dropout") and not n.startswith("attention")]


def _args(name, seed=0, dtype=F32):
    return tuple(rand(s, seed + i, dtype) for i, s in enumerate(CASES[name][2]))


def _f64(xs):
    return tuple(jnp.asarray(np.asarray(x, np.float64)) for x in xs)


def rel(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def _loss(f):
    # A nonlinear scalar of the outputs, so that second derivatives have every term.
    return lambda *a: jnp.sum(jnp.sin(2.0 * f(*a)))


# ---- accuracy against float64 --------------------------------------------------------------------------


def check_jvp_and_linearize(name):
    f, ref, _ = CASES[name]
    args, tangents = _args(name), _args(name, seed=10)
    y, t = jax.jvp(f, args, tangents)
    _, lin = jax.linearize(f, *args)
    assert t.dtype == y.dtype
    assert_bitwise(lin(*tangents), t)  # linearize's linear map is the same tangent map
    with jax.enable_x64(True):
        want = jax.jvp(ref, _f64(args), _f64(tangents))[1]
    assert rel(t, want) < 1e-5, rel(t, want)


def _second_order(f, args, tangents):
    """Forward over reverse (a Hessian-vector product), reverse over reverse, jax.jacfwd and
    jax.hessian (in the first argument), as one jitted program."""
    argnums = tuple(range(len(args)))
    L = _loss(f)
    return (
        jax.jvp(jax.grad(L, argnums), args, tangents)[1],
        jax.grad(lambda *a: sum(jnp.sum(g**2) for g in jax.grad(L, argnums)(*a)), argnums)(*args),
        jax.jacfwd(f)(*args),
        jax.hessian(L)(*args),
    )


def check_second_order(name):
    f, ref, _ = CASES[name]
    args, tangents = _args(name), _args(name, seed=10)
    got = jax.jit(lambda a, t: _second_order(f, a, t))(args, tangents)
    with jax.enable_x64(True):
        want = jax.jit(lambda a, t: _second_order(ref, a, t))(_f64(args), _f64(tangents))
    for what, g_, e_ in zip(("hvp", "grad of grad", "jacfwd", "hessian"), got, want):
        for g, e in zip(jax.tree.leaves(g_), jax.tree.leaves(e_)):
            assert rel(g, e) < 2e-5, (what, rel(g, e))


@pytest.mark.parametrize("name", list(CASES))
def test_jvp_and_linearize_match_float64(name):
    check_jvp_and_linearize(name)


@pytest.mark.parametrize("name", list(CASES))
def test_hvp_grad_of_grad_jacfwd_hessian_match_float64(name):
    check_second_order(name)


@pytest.mark.parametrize(
    "name",
    ["matmul", "rms_norm", "layer_norm", "softmax", "log_softmax", "label_log_probs"]
    + ["attention_causal", "attention_decode", "attention_d80"],
)
def test_half_precision_tangents(name):
    f, ref, _ = CASES[name]
    args, tangents = _args(name, dtype=jnp.bfloat16), _args(name, seed=10, dtype=jnp.bfloat16)
    y, t = jax.jvp(f, args, tangents)
    assert t.dtype == y.dtype
    with jax.enable_x64(True):
        want = jax.jvp(ref, _f64(args), _f64(tangents))[1]
    assert rel(t, want) < 3e-2, rel(t, want)


@pytest.mark.parametrize("name", ["attention_causal", "attention_lengths", "attention_decode", "attention_d80"])
def test_half_precision_second_derivatives_of_attention(name):
    # bfloat16 inputs: every second derivative keeps the dtype and is within 3e-2 of float64.
    f, ref, _ = CASES[name]
    args, tangents = _args(name, dtype=jnp.bfloat16), _args(name, seed=10, dtype=jnp.bfloat16)
    got = jax.jit(lambda a, t: _second_order(f, a, t))(args, tangents)
    with jax.enable_x64(True):
        want = jax.jit(lambda a, t: _second_order(ref, a, t))(_f64(args), _f64(tangents))
    for what, g_, e_ in zip(("hvp", "grad of grad", "jacfwd", "hessian"), got, want):
        for g, e in zip(jax.tree.leaves(g_), jax.tree.leaves(e_)):
            assert g.dtype == jnp.bfloat16 and rel(g, e) < 3e-2, (what, g.dtype, rel(g, e))


# ---- row contracts ------------------------------------------------------------------------------------


def check_tangent_rows(name, rows=16):
    """Row b of a batched tangent (and of a batched Hessian-vector product in the rows) is bitwise
    the tangent of row b alone, at the first, a middle and the last position."""
    f = CASES[name][0]
    shapes = [(rows,) + CASES[name][2][0][1:]] + CASES[name][2][1:]
    args = tuple(rand(s, i) for i, s in enumerate(shapes))
    tangents = tuple(rand(s, 10 + i) for i, s in enumerate(shapes))
    t = jax.jvp(f, args, tangents)[1]
    L = _loss(f)
    hvp = jax.jvp(lambda x: jax.grad(L)(x, *args[1:]), (args[0],), (tangents[0],))[1]
    for b in (0, rows // 2 - 1, rows - 1):
        one = lambda a: a[b : b + 1]  # noqa: E731
        if name in ("softmax_cross_entropy", "label_log_probs"):
            # The row's own label: the label of row b is LABELS[b].
            t_b = jax.jvp(lambda x: _row_xent(name, x, b), (one(args[0]),), (one(tangents[0]),))[1]
            hvp_b = jax.jvp(
                jax.grad(lambda x: jnp.sum(jnp.sin(2.0 * _row_xent(name, x, b)))), (one(args[0]),), (one(tangents[0]),)
            )[1]
        else:
            t_b = jax.jvp(f, (one(args[0]),) + args[1:], (one(tangents[0]),) + tangents[1:])[1]
            hvp_b = jax.jvp(lambda x: jax.grad(L)(x, *args[1:]), (one(args[0]),), (one(tangents[0]),))[1]
        assert_bitwise(one(t), t_b)
        assert_bitwise(one(hvp), hvp_b)


def _row_xent(name, x, b):
    fn = jaxdet.softmax_cross_entropy if name == "softmax_cross_entropy" else jaxdet.label_log_probs
    return fn(x, jnp.asarray(LABELS[b : b + 1], jnp.int32))


@pytest.mark.parametrize("name", ROW_OPS)
def test_tangent_rows_do_not_depend_on_the_batch(name):
    check_tangent_rows(name)


@pytest.mark.parametrize("name", ["rms_norm", "softmax", "matmul", "label_log_probs", "dropout"])
def test_tangents_under_jit_vmap_and_remat(name):
    f = CASES[name][0]
    args, tangents = _args(name), _args(name, seed=10)
    t = jax.jvp(f, args, tangents)[1]
    assert_bitwise(jax.jit(lambda a, t: jax.jvp(f, a, t)[1])(args, tangents), t)
    assert_bitwise(jax.jvp(jax.checkpoint(f), args, tangents)[1], t)
    if name != "dropout":  # a vmapped dropout draws each example's mask from index 0
        # vmap over halves of the rows: each half's tangent rows are the full batch's.
        halves = lambda a: a.reshape((2, a.shape[0] // 2) + a.shape[1:])  # noqa: E731
        if name == "label_log_probs":
            g = lambda x, tx, lab: jax.jvp(lambda x: jaxdet.label_log_probs(x, lab), (x,), (tx,))[1]  # noqa: E731
            got = jax.vmap(g)(halves(args[0]), halves(tangents[0]), halves(_labels(args[0])))
        else:
            g = lambda x, tx: jax.jvp(lambda x: f(x, *args[1:]), (x,), (tx,))[1]  # noqa: E731
            if len(args) > 1:
                t = jax.jvp(lambda x: f(x, *args[1:]), args[:1], tangents[:1])[1]
            got = jax.vmap(g)(halves(args[0]), halves(tangents[0]))
        assert_bitwise(got.reshape(t.shape), t)
    # Reverse mode over a forward-mode result (grad of a jvp), jitted, with and without remat.
    L = lambda a: jnp.sum(jax.jvp(f, (a,) + args[1:], tangents)[1] ** 2)  # noqa: E731
    assert_bitwise(jax.jit(jax.grad(L))(args[0]), jax.jit(jax.grad(jax.checkpoint(L)))(args[0]))


def test_reverse_mode_is_the_transpose_of_the_tangent_map():
    # The transpose of the tangent map is the backward kernels: jax.linear_transpose of the
    # linearized map gives jax.vjp's bits.
    x, w, g = rand((6, 16), 0), rand((16,), 1), rand((6, 16), 2)
    f = lambda x, w: jaxdet.layer_norm(x, w, None)  # noqa: E731
    y, lin = jax.linearize(f, x, w)
    transposed = jax.linear_transpose(lin, x, w)(g)
    for a, b in zip(transposed, jax.vjp(f, x, w)[1](g)):
        assert_bitwise(a, b)
    text = str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x, w) ** 2)))(x))
    assert "jaxdet_norm_rows_bwd" in text and "jaxdet_linear" not in text


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm"])
def test_second_derivatives_through_vmap_with_per_example_parameters(name):
    # jax.vmap with per-example scale (and bias) runs the grouped kernels; jax.hessian in the
    # parameters vmaps the tangents: both reach the grouped kernels' derivative rules.
    f, ref, shapes = CASES[name]
    args = tuple(rand((3, 4) + s[1:] if i == 0 else (3,) + s, i) for i, s in enumerate(shapes))
    tangents = tuple(rand(a.shape, 10 + i) for i, a in enumerate(args))
    argnums = tuple(range(len(args)))
    hvp = lambda f: lambda a, t: jax.jvp(jax.grad(_loss(jax.vmap(f)), argnums), a, t)[1]  # noqa: E731
    got = jax.jit(hvp(f))(args, tangents)
    hess = jax.jit(jax.hessian(_loss(f), 1))(args[0][0], *(a[0] for a in args[1:]))
    with jax.enable_x64(True):
        want = jax.jit(hvp(ref))(_f64(args), _f64(tangents))
        want_hess = jax.hessian(_loss(ref), 1)(*_f64([args[0][0], *(a[0] for a in args[1:])]))
    for g, e in zip(got, want):
        assert rel(g, e) < 2e-5, rel(g, e)
    assert rel(hess, want_hess) < 2e-5, rel(hess, want_hess)


# ---- attention ----------------------------------------------------------------------------------------


def _bwd_kernel_grads(q, k, v, g):
    """jaxdet.attention's backward kernel bound directly on a causal pass (D = 64: no padding), as
    jax.grad ran it before attention had forward mode: the bits gradients must keep."""
    from jaxdet._src.attention.attention import CAUSAL_POSITIONS, bwd_p, fwd_p

    B, T, N, D = q.shape
    K = k.shape[2]
    q5 = q.reshape(B, T, K, N // K, D)
    rows = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), jnp.full((B,), T, jnp.int32)
    params = dict(scale=1.0 / np.sqrt(D), row_form=CAUSAL_POSITIONS)
    o, lse2 = fwd_p.bind(q5, k, v, *rows, **params)
    dq, dk, dv = bwd_p.bind(q5, k, v, o, lse2, g.reshape(q5.shape), *rows, **params)
    return dq.reshape(q.shape), dk, dv


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["f32", "bf16"])
def test_attention_primal_and_reverse_mode_keep_the_kernels_bits(dtype):
    # The primal of jax.jvp is the forward kernel's output; reverse mode is the transpose of the
    # tangent map, which is the backward kernel: jax.grad, jax.vjp and jax.linear_transpose of
    # jax.linearize's map give the backward kernel's bits, and jax.grad's program holds that
    # kernel and no tangent map.
    q, k, v = rand((2, 8, 4, 64), 0, dtype), rand((2, 8, 2, 64), 1, dtype), rand((2, 8, 2, 64), 2, dtype)
    tangents, g = (rand(x.shape, 10 + i, dtype) for i, x in enumerate((q, k, v))), rand(q.shape, 20, dtype)
    y = jax.jvp(jaxdet.attention, (q, k, v), tuple(tangents))[0]
    assert_bitwise(y, jaxdet.attention(q, k, v))
    want = _bwd_kernel_grads(q, k, v, g)
    _, lin = jax.linearize(jaxdet.attention, q, k, v)
    for got in (
        jax.vjp(jaxdet.attention, q, k, v)[1](g),
        jax.linear_transpose(lin, q, k, v)(g),
        jax.jit(jax.grad(lambda *a: jnp.sum(jaxdet.attention(*a).astype(F32) * g), (0, 1, 2)))(q, k, v),
    ):
        for a, b, name in zip(got, want, ("dq", "dk", "dv")):
            assert_bitwise(a, b, name)
    # The gradient of q alone is the same kernel's dq.
    assert_bitwise(jax.vjp(lambda q: jaxdet.attention(q, k, v), q)[1](g)[0], want[0])
    text = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(jaxdet.attention(q, k, v).astype(F32) ** 2)))(q))
    assert "jaxdet_attention_bwd" in text and "jaxdet_linear" not in text


def _attention_inputs(B, T, S, dtype=F32, N=4, K=2, D=32, seed=0):
    return tuple(rand(s, seed + i, dtype) for i, s in enumerate([(B, T, N, D), (B, S, K, D), (B, S, K, D)]))


def check_attention_tangent_rows(dtype=F32):
    """Sequence b's tangent rows in a batch of 3 (and its rows of a Hessian-vector product in q, k
    and v held) are bitwise those of sequence b alone."""
    kv_lengths = jnp.asarray([5, 8, 3], jnp.int32)
    f = lambda q, k, v, n: jaxdet.attention(q, k, v, kv_lengths=n)  # noqa: E731
    args, tangents = _attention_inputs(3, 8, 8, dtype), _attention_inputs(3, 8, 8, dtype, seed=10)
    t = jax.jvp(lambda *a: f(*a, kv_lengths), args, tangents)[1]

    def hvp(q, k, v, tq, n):
        return jax.jvp(jax.grad(lambda q: jnp.sum(jnp.sin(2.0 * f(q, k, v, n).astype(F32)))), (q,), (tq,))[1]

    h = hvp(*args, tangents[0], kv_lengths)
    for b in range(3):
        one = lambda x: x[b : b + 1]  # noqa: E731
        t_b = jax.jvp(lambda *a: f(*a, one(kv_lengths)), tuple(map(one, args)), tuple(map(one, tangents)))[1]
        assert_bitwise(one(t), t_b, f"tangent of sequence {b}")
        assert_bitwise(one(h), hvp(*map(one, args), one(tangents[0]), one(kv_lengths)), f"hvp of sequence {b}")


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["f32", "bf16"])
def test_attention_tangent_rows_do_not_depend_on_the_batch(dtype):
    check_attention_tangent_rows(dtype)


def check_attention_decode_tangents(dtype=F32):
    """A decode step's (and a prefill chunk's) tangent against a KV cache of 16 rows whose unused
    rows hold NaN, in its primal and tangents, has bitwise the full causal pass's rows: masked keys
    add exact zeros, appended after the visible ones."""
    T, cap = 10, 16
    args, tangents = _attention_inputs(2, T, T, dtype), _attention_inputs(2, T, T, dtype, seed=10)
    full = jax.jvp(jaxdet.attention, args, tangents)[1]

    def cache(x):
        return jnp.concatenate([x, jnp.full((x.shape[0], cap - T) + x.shape[2:], np.nan, x.dtype)], 1)

    for lo, hi in ((0, 1), (4, 5), (9, 10), (3, 7)):

        def step(q, k, v, lo=lo, hi=hi):
            pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (2, hi - lo))
            return jaxdet.attention(q, k, v, q_positions=pos, kv_lengths=jnp.full((2,), hi, jnp.int32))

        chunk = lambda x, lo=lo, hi=hi: x[:, lo:hi]  # noqa: E731
        t = jax.jvp(step, (chunk(args[0]), *map(cache, args[1:])), (chunk(tangents[0]), *map(cache, tangents[1:])))[1]
        assert_bitwise(t, chunk(full), f"queries {lo}..{hi - 1}")


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["f32", "bf16"])
def test_attention_decode_tangents_equal_the_full_pass(dtype):
    check_attention_decode_tangents(dtype)


def test_attention_rows_of_a_non_contiguous_traced_mask():
    # A traced mask row whose keys are not one run has a NaN output, as without derivatives, and a
    # zero tangent; the other rows' tangents are finite.
    q, k, v = _attention_inputs(1, 4, 4)
    mask = np.tril(np.ones((4, 4), bool))
    mask[2, 1] = False  # row 2 sees keys 0 and 2

    @jax.jit
    def jvp(mask, args, tangents):
        return jax.jvp(lambda q, k, v: jaxdet.attention(q, k, v, mask=mask), args, tangents)

    y, t = jvp(mask, (q, k, v), _attention_inputs(1, 4, 4, seed=10))
    assert_bitwise(y, jax.jit(lambda m, q, k, v: jaxdet.attention(q, k, v, mask=m))(mask, q, k, v))
    y, t = np.asarray(y), np.asarray(t)
    assert np.isnan(y[:, 2]).all() and np.isfinite(np.delete(y, 2, 1)).all()
    assert (t[:, 2] == 0).all() and np.isfinite(t).all() and (np.delete(t, 2, 1) != 0).any()


@pytest.mark.parametrize("blocks", [False, True], ids=["one_block", "query_blocks"])
def test_attention_tangents_under_jit_vmap_and_remat(blocks, monkeypatch):
    kv_lengths = jnp.asarray([5, 8, 3, 8], jnp.int32)
    f = lambda q, k, v, n: jaxdet.attention(q, k, v, kv_lengths=n)  # noqa: E731
    args, tangents = _attention_inputs(4, 8, 8), _attention_inputs(4, 8, 8, seed=10)
    jvp = lambda a, t, n: jax.jvp(lambda *a: f(*a, n), a, t)[1]  # noqa: E731
    t = jvp(args, tangents, kv_lengths)
    if blocks:
        # Blocks of 3 query positions (3 blocks, the last padded); under vmap over halves of the
        # batch the same budget gives blocks of 6 (2 blocks): every variant has the one-block bits.
        set_query_block(monkeypatch, [a.shape for a in args], 3)
        assert_runs_in_query_blocks(jvp, args, tangents, kv_lengths)
        assert_bitwise(jvp(args, tangents, kv_lengths), t, "eager")
    assert_bitwise(jax.jit(jvp)(args, tangents, kv_lengths), t, "jit")
    assert_bitwise(jax.jvp(jax.checkpoint(lambda *a: f(*a, kv_lengths)), args, tangents)[1], t, "remat")
    halves = lambda x: x.reshape((2, 2) + x.shape[1:])  # noqa: E731
    got = jax.vmap(jvp)(*jax.tree.map(halves, (args, tangents, kv_lengths)))
    assert_bitwise(got.reshape(t.shape), t, "vmap over halves of the batch")
    # Reverse mode over a forward-mode result (grad of a jvp), jitted, with and without remat.
    L = lambda q: jnp.sum(jvp((q,) + args[1:], tangents, kv_lengths) ** 2)  # noqa: E731
    assert_bitwise(jax.jit(jax.grad(L))(args[0]), jax.jit(jax.grad(jax.checkpoint(L)))(args[0]), "grad of jvp")


# ---- attention's tangent in blocks of query positions ---------------------------------------------------


def set_query_block(monkeypatch, shapes, positions):
    """Sets the tangent's budget (TANGENT_BLOCK_BYTES) to `positions` query positions' float32 scores
    of attention on q, k of `shapes` [(B, T, N, D), (B, S, K, D), ...]."""
    from jaxdet._src.attention import attention as module

    (B, _, N, _), (_, S, _, _) = shapes[:2]
    monkeypatch.setattr(module, "TANGENT_BLOCK_BYTES", B * N * S * 4 * positions)


def assert_runs_in_query_blocks(f, *args):
    """jit(f)'s program loops over blocks (the one-block tangent has no loop)."""
    assert "stablehlo.while" in jax.jit(f).lower(*args).as_text(), "the tangent ran in one block"


# (form, query positions per block): T = 6 in blocks of 4 (the last one padded; causal also in blocks of
# 1); the decode form's T = 2 in blocks of 1.
_BLOCKED_FORMS = [(form, 1 if form == "decode" else 4) for form in ATTENTION_FORMS] + [("causal", 1)]


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("form,positions", _BLOCKED_FORMS, ids=[f"{f}-{n}" for f, n in _BLOCKED_FORMS])
def test_attention_tangent_in_query_blocks_has_the_one_block_bits(form, positions, dtype, monkeypatch):
    # Every tangent row is computed from its own query (products and sums per row), so the tangent
    # computed in blocks of query positions, eager and jitted, in any subset of (q, k, v), has the
    # bits of the tangent computed in one block, in every row form, with grouped-query heads.
    name = f"attention_{form}"
    f, _, shapes = CASES[name]
    args, tangents = _args(name, dtype=dtype), _args(name, seed=10, dtype=dtype)
    subsets = {"qkv": (0, 1, 2), "q": (0,), "kv": (1, 2)}

    def tangent(which, a, t):
        held = lambda *x: f(*[x[which.index(i)] if i in which else a[i] for i in range(3)])  # noqa: E731
        return jax.jvp(held, tuple(a[i] for i in which), tuple(t[i] for i in which))[1]

    want = {w: tangent(idx, args, tangents) for w, idx in subsets.items()}
    set_query_block(monkeypatch, shapes, positions)
    assert_runs_in_query_blocks(lambda a, t: tangent(subsets["qkv"], a, t), args, tangents)
    for w, idx in subsets.items():
        assert_bitwise(tangent(idx, args, tangents), want[w], f"tangent in {w}")
    assert_bitwise(jax.jit(lambda a, t: tangent(subsets["qkv"], a, t))(args, tangents), want["qkv"], "jit")


@pytest.mark.parametrize("form,positions", [("causal", 4), ("decode", 1)])
def test_attention_forward_mode_in_query_blocks_matches_float64(form, positions, monkeypatch):
    # jax.jvp, jax.linearize and jax.jacfwd (and the second derivatives beside them) with the tangent
    # in several blocks, against float64.
    name = f"attention_{form}"
    set_query_block(monkeypatch, CASES[name][2], positions)
    args, tangents = _args(name), _args(name, seed=10)
    assert_runs_in_query_blocks(lambda a, t: jax.jvp(CASES[name][0], a, t)[1], args, tangents)
    check_jvp_and_linearize(name)
    check_second_order(name)


# ---- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_forward_mode_accuracy(name, on_gpu):
    check_jvp_and_linearize(name)
    check_second_order(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ROW_OPS)
def test_gpu_tangent_rows_do_not_depend_on_the_batch(name, on_gpu):
    check_tangent_rows(name)


@pytest.mark.gpu
def test_gpu_attention_tangent_rows_and_decode_steps(on_gpu):
    for dtype in (F32, jnp.bfloat16):
        check_attention_tangent_rows(dtype)
        check_attention_decode_tangents(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_attention_tangent_in_query_blocks_has_the_one_block_bits(dtype, monkeypatch, on_gpu):
    # On the GPU the products' tile depends on their row count: 600 query rows per (sequence, KV
    # head) in one block, 96 in blocks of 48 positions (the last one of 12): the same bits.
    kv_lengths = jnp.asarray([300, 170], jnp.int32)
    jvp = lambda a, t: jax.jvp(lambda q, k, v: jaxdet.attention(q, k, v, kv_lengths=kv_lengths), a, t)[1]  # noqa: E731
    args = _attention_inputs(2, 300, 300, dtype, D=64)
    tangents = _attention_inputs(2, 300, 300, dtype, D=64, seed=10)
    want = jax.jit(jvp)(args, tangents)
    set_query_block(monkeypatch, [a.shape for a in args], 48)
    blocked = lambda a, t: jvp(a, t)  # noqa: E731  (a new function: jit traces it again)
    assert_runs_in_query_blocks(blocked, args, tangents)
    assert_bitwise(jax.jit(blocked)(args, tangents), want)
