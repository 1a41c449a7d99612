"""Forward mode and second derivatives (docs/derivatives.md): jax.jvp, jax.linearize, jax.jacfwd,
jax.hessian and grad of grad through matmul, dropout, the norms, the softmax family and jaxdet.sum,
against float64 references by relative norm; tangent rows bitwise independent of the batch; the
same bits under jit, vmap and remat (inside shard_map and under sharded jit:
tests/test_rowops_sharding.py::test_tangents_in_shard_map_and_sharded_jit_equal_one_device).
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
}
# Dropout's mask is indexed by the element's position in the array (docs/dropout.md), not by row.
ROW_OPS = [n for n in CASES if n not in ("matmul_batched", "dropout")]


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


@pytest.mark.parametrize("name", ["matmul", "rms_norm", "layer_norm", "softmax", "log_softmax", "label_log_probs"])
def test_half_precision_tangents(name):
    f, ref, _ = CASES[name]
    args, tangents = _args(name, dtype=jnp.bfloat16), _args(name, seed=10, dtype=jnp.bfloat16)
    y, t = jax.jvp(f, args, tangents)
    assert t.dtype == y.dtype
    with jax.enable_x64(True):
        want = jax.jvp(ref, _f64(args), _f64(tangents))[1]
    assert rel(t, want) < 3e-2, rel(t, want)


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


def test_attention_forward_mode_raises_not_implemented():
    q = rand((1, 8, 2, 64), 0)
    with pytest.raises(NotImplementedError, match=r"jaxdet\.attention supports reverse-mode.*jax\.jacrev"):
        jax.jvp(lambda q: jaxdet.attention(q, q, q), (q,), (q,))


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
