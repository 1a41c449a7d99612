"""Batch-invariant softmax, log_softmax and cross-entropy with integer labels, bitwise equal on CPU
and GPU.

The contracts (docs/softmax.md, proven by tests/test_softmax.py):

* Row invariance, forward and backward: a row's outputs (and input gradient) depend only on that
  row (and its cotangent, its label); every row is reduced in the canonical order of segments,
  lanes and trees (cuda/softmax/softmax_math.h), whatever the number of rows.
* CPU == GPU bitwise: the same float32 operations in the same order on both backends, with exp and
  log from one header compiled for both (cuda/common/det_math.h).
* ``label_log_probs(x, labels) == -softmax_cross_entropy_with_integer_labels(x, labels)`` and
  ``== take_along_axis(log_softmax(x), labels)`` (float32 x), bit for bit.
* Derivatives: each tangent is a linear map transposed by the backward kernel; second derivatives
  differentiate the kernels through their formulas with jaxdet.sum (docs/derivatives.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad

from jaxdet._src.core import autodiff, batching, checks, ffi, tree, varying
from jaxdet._src.reduce.reduce import sum as canonical_sum

__all__ = [
    "softmax",
    "log_softmax",
    "softmax_cross_entropy_with_integer_labels",
    "softmax_cross_entropy",
    "label_log_probs",
    "SEGMENT",
]

# Elements per segment of a row (cuda/softmax/softmax_math.h kSegment): rows longer than this are
# reduced segment by segment and the segments combined by the canonical tree.
SEGMENT = 8192

_F32 = np.dtype(jnp.float32)
_I32 = np.dtype(jnp.int32)
_MODES = {"softmax": 0, "log_softmax": 1}


def _segments(n):
    return 1 if n <= SEGMENT else -(-n // SEGMENT)


def _stat_width(n):
    # The statistics a forward saves: M, S and, for rows of several segments, each segment's max
    # (cuda/softmax/softmax_math.h stat_width).
    s = _segments(n)
    return 2 + s if s > 1 else 2


def _workspace_segments(n):
    # The CUDA kernels keep per-segment partials there when a row has several segments.
    s = _segments(n)
    return s if s > 1 else 0


def _fold_rows(args, dims):
    """Moves the vmapped axis to the front (broadcasting unmapped arguments) and folds it into the
    rows: every argument's leading axis is the row axis."""
    size = batching.batch_size(args, dims)
    flat = []
    for a, d in zip(args, dims):
        moved = batching.moved_to_front(a, d, size)
        flat.append(moved.reshape((size * moved.shape[1],) + moved.shape[2:]))
    return size, flat


def _batch_rows(primitive):
    """The batching rule of a primitive on rows: the vmapped axis is folded into the rows, the
    primitive runs once, and every result is unfolded (a row's bits do not depend on the others)."""

    def rule(args, dims, **params):
        size, flat = _fold_rows(args, dims)
        outs = primitive().bind(*flat, **params)
        if isinstance(outs, (list, tuple)):
            return [batching.unfold(o, size) for o in outs], [0] * len(outs)
        return batching.unfold(outs, size), 0

    return rule


# ---- jaxdet_softmax_fwd: x [R, n] -> y [R, n], stats f32 [R, W] = (M, S, segment maxima), workspace. ----


def _sfwd_abstract_eval(x, *, mode):
    R, n = x.shape
    return (
        ffi.shaped(x.shape, x.dtype),
        ffi.shaped((R, _stat_width(n)), _F32),
        ffi.shaped((R, _workspace_segments(n), 2), _F32),
    )


softmax_fwd_p = ffi.define_primitive(
    "jaxdet_softmax_fwd",
    _sfwd_abstract_eval,
    attributes=lambda mode: dict(mode=np.int32(mode)),
    batching_rule=_batch_rows(lambda: softmax_fwd_p),
    multiple_results=True,
)


# ---- jaxdet_softmax_bwd: x, stats, g -> dx [R, n], workspace. ----


def _sbwd_abstract_eval(x, stats, g, *, mode):
    R, n = x.shape
    return (ffi.shaped(x.shape, x.dtype), ffi.shaped((R, _workspace_segments(n)), _F32))


softmax_bwd_p = ffi.define_primitive(
    "jaxdet_softmax_bwd",
    _sbwd_abstract_eval,
    attributes=lambda mode: dict(mode=np.int32(mode)),
    batching_rule=_batch_rows(lambda: softmax_bwd_p),
    multiple_results=True,
)


# ---- jaxdet_xent_fwd: logits [R, n], labels int32 [R] -> out f32 [R], stats, workspace. ----


def _xfwd_abstract_eval(x, labels, *, log_prob):
    R, n = x.shape
    return (
        ffi.shaped((R,), _F32),
        ffi.shaped((R, _stat_width(n)), _F32),
        ffi.shaped((R, _workspace_segments(n), 2), _F32),
    )


xent_fwd_p = ffi.define_primitive(
    "jaxdet_xent_fwd",
    _xfwd_abstract_eval,
    attributes=lambda log_prob: dict(log_prob=bool(log_prob)),
    batching_rule=_batch_rows(lambda: xent_fwd_p),
    multiple_results=True,
)


# ---- jaxdet_xent_bwd: logits, labels, stats, g f32 [R] -> dlogits [R, n]. ----


def _xbwd_abstract_eval(x, labels, stats, g):
    return ffi.shaped(x.shape, x.dtype)


xent_bwd_p = ffi.define_primitive(
    "jaxdet_xent_bwd", _xbwd_abstract_eval, attributes=lambda: {}, batching_rule=_batch_rows(lambda: xent_bwd_p)
)


# ---- jaxdet_det_math: the shared exp / log / rsqrt elementwise on float32 (tests and report). ----

_MATH_OPS = {"exp": 0, "log": 1, "rsqrt": 2, "exp_nonpositive": 3}

det_math_p = ffi.define_primitive(
    "jaxdet_det_math",
    lambda x, *, op: ffi.shaped(x.shape, _F32),
    attributes=lambda op: dict(op=np.int32(op)),
    batching_rule=lambda args, dims, *, op: (det_math_p.bind(args[0], op=op), dims[0]),
)


def det_math(x, op: str):
    """det_math.h's ``exp``, ``log``, ``rsqrt`` or ``exp_nonpositive`` of a float32 array, on x's
    device: the functions every softmax kernel uses (the same bits on CPU and GPU).
    ``exp_nonpositive`` is ``exp`` for x <= 0 or NaN (softmax's x - M), unspecified elsewhere."""
    if op not in _MATH_OPS:
        raise ValueError(f"op must be one of {sorted(_MATH_OPS)}, got {op!r}")
    x = jnp.asarray(x)
    if np.dtype(x.dtype) != _F32:
        raise TypeError(f"x must be float32, got {np.dtype(x.dtype).name}")
    return det_math_p.bind(x, op=_MATH_OPS[op])


# ---- Composite primitives on the rows as the user shaped them, x [*R, n] (every leading dimension a
# row dimension), so that under sharded jit a split of any row dimension stays on its device with no
# collective; the class axis n is never split (a split one is all-gathered). ----


def _flat(x):
    return x.reshape(-1, x.shape[-1])


def _row_factors(shape, trailing):
    return tuple(f"r{i}" for i in range(len(shape) - trailing))


def _fold_into_rows(prim, args, dims, params, nout):
    """A vmapped axis is one more leading row dimension: move it to the front everywhere."""
    size = batching.batch_size(args, dims)
    out = prim.bind(*[batching.moved_to_front(a, d, size) for a, d in zip(args, dims)], **params)
    return out, ([0] * nout if prim.multiple_results else 0)


def _composite(name, abstract_eval, factors, local, nout):
    prim = None

    def batch(args, dims, **params):
        return _fold_into_rows(prim, args, dims, params, nout)

    prim = ffi.define_composite(
        name,
        abstract_eval,
        ffi.Partitioning(factors, replicated=frozenset({"n", "stats"}), local=local),
        batching_rule=batch,
        multiple_results=nout > 1,
    )
    return prim


def _sm_local(params, axes, shapes):
    def run(x):
        y, stats, _ = softmax_fwd_p.bind(_flat(x), mode=params["mode"])
        return [y.reshape(x.shape), stats.reshape(x.shape[:-1] + stats.shape[-1:])]

    return run


softmax_rows_p = _composite(
    "jaxdet_softmax_rows",
    lambda x, *, mode: [
        ffi.shaped(x.shape, x.dtype),
        ffi.shaped(x.shape[:-1] + (_stat_width(x.shape[-1]),), _F32),
    ],
    lambda params, shapes: (
        [_row_factors(shapes[0], 1) + ("n",)],
        [_row_factors(shapes[0], 1) + ("n",), _row_factors(shapes[0], 1) + ("stats",)],
    ),
    _sm_local,
    2,
)


def _sm_bwd_local(params, axes, shapes):
    def run(x, stats, g):
        flat_stats = stats.reshape(-1, stats.shape[-1])
        return softmax_bwd_p.bind(_flat(x), flat_stats, _flat(g), mode=params["mode"])[0].reshape(x.shape)

    return run


softmax_rows_bwd_p = _composite(
    "jaxdet_softmax_rows_bwd",
    lambda x, stats, g, *, mode: ffi.shaped(x.shape, x.dtype),
    lambda params, shapes: (
        [
            _row_factors(shapes[0], 1) + ("n",),
            _row_factors(shapes[0], 1) + ("stats",),
            _row_factors(shapes[0], 1) + ("n",),
        ],
        [_row_factors(shapes[0], 1) + ("n",)],
    ),
    _sm_bwd_local,
    1,
)


def _xent_local(params, axes, shapes):
    def run(x, labels):
        out, stats, _ = xent_fwd_p.bind(_flat(x), labels.reshape(-1), log_prob=params["log_prob"])
        return [out.reshape(labels.shape), stats.reshape(labels.shape + stats.shape[-1:])]

    return run


xent_rows_p = _composite(
    "jaxdet_xent_rows",
    lambda x, labels, *, log_prob: [
        ffi.shaped(labels.shape, _F32),
        ffi.shaped(labels.shape + (_stat_width(x.shape[-1]),), _F32),
    ],
    lambda params, shapes: (
        [_row_factors(shapes[0], 1) + ("n",), _row_factors(shapes[0], 1)],
        [_row_factors(shapes[0], 1), _row_factors(shapes[0], 1) + ("stats",)],
    ),
    _xent_local,
    2,
)


def _xent_bwd_local(params, axes, shapes):
    def run(x, labels, stats, g):
        flat_stats = stats.reshape(-1, stats.shape[-1])
        return xent_bwd_p.bind(_flat(x), labels.reshape(-1), flat_stats, g.reshape(-1)).reshape(x.shape)

    return run


xent_rows_bwd_p = _composite(
    "jaxdet_xent_rows_bwd",
    lambda x, labels, stats, g: ffi.shaped(x.shape, x.dtype),
    lambda params, shapes: (
        [
            _row_factors(shapes[0], 1) + ("n",),
            _row_factors(shapes[0], 1),
            _row_factors(shapes[0], 1) + ("stats",),
            _row_factors(shapes[0], 1),
        ],
        [_row_factors(shapes[0], 1) + ("n",)],
    ),
    _xent_bwd_local,
    1,
)


# ---- Differentiable cores on x [..., n] (the class axis last).
#
# Each tangent is a linear map (`autodiff.linear_call`) whose transpose is the existing backward
# kernel, so reverse mode runs exactly that kernel:
# * softmax: J = diag(p) - p pᵀ is symmetric, so the tangent J t is the backward kernel on t;
# * log_softmax: J t = t - sum(p * t) (a jaxdet.sum over the classes, p the softmax kernel's output);
# * cross-entropy: d loss = sum((p - onehot) * t), (p - onehot) the backward kernel with a unit
#   cotangent, the sum a jaxdet.sum over the classes (label_log_probs: its negation).
# The row statistics are a cache of x: every derivative is taken through x (the kernels' own
# derivatives, for second order, are their formulas with p = jaxdet.softmax(x)), so the statistics'
# tangent is zero. ----


def _class_sum(v):
    return canonical_sum(v, axis=-1)


def _probs(x):
    """softmax(x) in float32 (the kernel's result, rounded to x's dtype, widened), differentiable."""
    return _softmax_rows(x, _MODES["softmax"]).astype(_F32)


def _softmax_transpose(x, mode):
    vma = varying.varying_axes(x)

    def transpose(x, stats, g):
        # The probabilities are recomputed from x and the row statistics in float32 (never from a
        # bfloat16/float16 output), exactly as the forward computed them.
        return (tree.match_varying(softmax_rows_bwd_p.bind(x, stats, g, mode=mode), vma),)

    return transpose


def _softmax_tangent_fn(mode):
    def fn(x, stats, t):
        if mode == _MODES["softmax"]:
            return (softmax_rows_bwd_p.bind(x, stats, t, mode=mode),)
        tf = t.astype(_F32)
        return ((tf - _class_sum(_probs(x) * tf)[..., None]).astype(x.dtype),)

    return fn


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _softmax_rows(x, mode):
    return softmax_rows_p.bind(x, mode=mode)[0]


def _softmax_tangent(x, stats, tx, mode):
    return autodiff.linear_call(_softmax_tangent_fn(mode), _softmax_transpose(x, mode), (x, stats), (tx,))[0]


def _softmax_rows_jvp(mode, primals, tangents):
    (x,), (tx,) = primals, tangents
    y, stats = softmax_rows_p.bind(x, mode=mode)
    if autodiff.is_zero(tx):
        return y, jnp.zeros_like(y)
    return y, _softmax_tangent(x, stats, tx, mode)


_softmax_rows.defjvp(_softmax_rows_jvp, symbolic_zeros=True)


def _softmax_fwd_jvp(primals, tangents, *, mode):
    (x,), (tx,) = primals, tangents
    y, stats = softmax_rows_p.bind(x, mode=mode)
    ty = autodiff.zero_tangent(y) if type(tx) is ad.Zero else _softmax_tangent(x, stats, tx, mode)
    return (y, stats), [ty, autodiff.zero_tangent(stats)]


def _softmax_bwd_formula(x, stats, g, *, mode):
    p, gf = _probs(x), g.astype(_F32)
    if mode == _MODES["softmax"]:
        return p * (gf - _class_sum(gf * p)[..., None])
    return gf - p * _class_sum(gf)[..., None]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _xent_rows(x, labels, log_prob):
    return xent_rows_p.bind(x, labels, log_prob=log_prob)[0]


def _xent_transpose(x, log_prob):
    vma = varying.varying_axes(x)

    def transpose(x, labels, stats, g):
        # d(log p_label) = -d(loss): negating the cotangent is exact.
        return (tree.match_varying(xent_rows_bwd_p.bind(x, labels, stats, -g if log_prob else g), vma),)

    return transpose


def _xent_tangent_fn(log_prob):
    def fn(x, labels, stats, t):
        # p - onehot(label), in x's dtype: the backward kernel with a unit cotangent.
        d = xent_rows_bwd_p.bind(x, labels, stats, jnp.ones(labels.shape, _F32)).astype(_F32)
        out = _class_sum(d * t.astype(_F32))
        return (-out if log_prob else out,)

    return fn


def _xent_tangent(x, labels, stats, tx, log_prob):
    return autodiff.linear_call(_xent_tangent_fn(log_prob), _xent_transpose(x, log_prob), (x, labels, stats), (tx,))[0]


def _xent_rows_jvp(log_prob, primals, tangents):
    (x, labels), (tx, _) = primals, tangents
    out, stats = xent_rows_p.bind(x, labels, log_prob=log_prob)
    if autodiff.is_zero(tx):
        return out, jnp.zeros_like(out)
    return out, _xent_tangent(x, labels, stats, tx, log_prob)


_xent_rows.defjvp(_xent_rows_jvp, symbolic_zeros=True)


def _xent_fwd_jvp(primals, tangents, *, log_prob):
    (x, labels), (tx, _) = primals, tangents
    out, stats = xent_rows_p.bind(x, labels, log_prob=log_prob)
    t = autodiff.zero_tangent(out) if type(tx) is ad.Zero else _xent_tangent(x, labels, stats, tx, log_prob)
    return (out, stats), [t, autodiff.zero_tangent(stats)]


def _xent_bwd_formula(x, labels, stats, g):
    # g * (p - onehot): the value is the kernel's p - onehot, the derivative in x that of
    # p = jaxdet.softmax(x) (the one-hot part does not depend on x).
    sg = jax.lax.stop_gradient
    d = xent_rows_bwd_p.bind(sg(x), labels, sg(stats), jnp.ones(labels.shape, _F32)).astype(_F32)
    p = _probs(x)
    return g.astype(_F32)[..., None] * (jax.lax.stop_gradient(d - p) + p)


ad.primitive_jvps[softmax_rows_p] = _softmax_fwd_jvp
ad.primitive_jvps[xent_rows_p] = _xent_fwd_jvp
autodiff.jvp_of_formula(softmax_rows_bwd_p, _softmax_bwd_formula)
autodiff.jvp_of_formula(xent_rows_bwd_p, _xent_bwd_formula)


# ---- Public functions. ----


def _rows_of(x, axis, name):
    x = checks.check_float_array(x, name)
    if x.ndim < 1:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")
    axis = checks.check_axis(axis, x.ndim)
    moved = jnp.moveaxis(x, axis, -1) if axis != x.ndim - 1 else x
    return moved, axis


def _softmax_like(x, axis, mode):
    moved, axis = _rows_of(x, axis, "x")
    if moved.size == 0:
        return tree.match_varying(jnp.zeros(x.shape, x.dtype), varying.varying_axes(x))
    y = _softmax_rows(moved, _MODES[mode])
    return jnp.moveaxis(y, -1, axis) if axis != x.ndim - 1 else y


def softmax(x, axis: int = -1):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis``, batch-invariant and CPU == GPU bitwise.

    x: float32, bfloat16 or float16. The statistics and arithmetic are float32, in the order of
    docs/softmax.md; the result is rounded once to x's dtype. Differentiable to any order, forward
    and reverse (docs/derivatives.md): the backward recomputes the float32 probabilities and reduces
    ``g * p`` in the same canonical order; the tangent is that backward applied to the tangent.
    A non-last ``axis`` costs a transpose.
    """
    return _softmax_like(x, axis, "softmax")


def log_softmax(x, axis: int = -1):
    """``(x - max) - log(sum(exp(x - max)))`` along ``axis``; see :func:`softmax`."""
    return _softmax_like(x, axis, "log_softmax")


def _labels_int32(labels, n, expected_shape):
    if not (hasattr(labels, "dtype") and hasattr(labels, "shape")):
        raise TypeError(f"labels must be an integer array, got {type(labels).__name__}")
    dtype = np.dtype(labels.dtype)
    if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
        raise TypeError(
            f"labels must be integer class indices (int32 or another integer dtype), got {dtype.name}; "
            "probability or one-hot labels are not supported (optax.softmax_cross_entropy takes those)"
        )
    if tuple(labels.shape) != tuple(expected_shape):
        raise ValueError(
            f"labels must have the logits' shape without the class axis, {tuple(expected_shape)}, "
            f"got {tuple(labels.shape)}"
        )
    labels = jnp.asarray(labels)
    if dtype.itemsize > 4 or dtype == np.uint32:
        # Wider labels are narrowed without letting an out-of-range value wrap into range.
        labels = jnp.where((labels < 0) | (labels >= n), -1, labels)
    return labels.astype(_I32)


def _xent(logits, labels, axis, log_prob):
    moved, _ = _rows_of(logits, axis, "logits")
    n = moved.shape[-1]
    if n == 0:
        raise ValueError("logits must have at least one class (the class axis has size 0)")
    labels = _labels_int32(labels, n, moved.shape[:-1])
    if moved.size == 0:
        return tree.match_varying(jnp.zeros(labels.shape, _F32), varying.varying_union(moved, labels))
    return _xent_rows(moved, labels, log_prob)


def softmax_cross_entropy_with_integer_labels(logits, labels, axis: int = -1):
    """Per-token cross-entropy ``logsumexp(logits) - logits[label]`` (optax's name and argument order).

    Args:
      logits: ``[..., n]`` float32, bfloat16 or float16 (the class axis is ``axis``).
      labels: integer class indices with the logits' shape minus the class axis.

    Returns float32 losses of labels' shape, computed as ``log(S) - (x_label - M)`` with the row's
    statistics (M, S) of docs/softmax.md (the same as log_softmax's). A label outside
    ``[0, n)`` gives a NaN loss (no clamping); its logits gradient is NaN, or zero where the loss's
    cotangent is zero (a masked token). Differentiable in ``logits`` to any order, forward and reverse
    (docs/derivatives.md): the gradient is ``g * (softmax(logits) - one_hot(label))``, elementwise,
    with the softmax recomputed in float32.
    """
    return _xent(logits, labels, axis, log_prob=False)


def softmax_cross_entropy(logits, labels, axis: int = -1):
    """Cross-entropy with **integer** labels: the same as
    :func:`softmax_cross_entropy_with_integer_labels` (probability labels raise a TypeError)."""
    return _xent(logits, labels, axis, log_prob=False)


def label_log_probs(logits, labels, axis: int = -1):
    """Per-token log-probabilities of the labels, ``(x_label - M) - log(S)``: bitwise
    ``-softmax_cross_entropy_with_integer_labels(logits, labels)`` and, for float32 logits,
    ``take_along_axis(log_softmax(logits), labels)``. NaN for an out-of-range label."""
    return _xent(logits, labels, axis, log_prob=True)


def _softmax_public(params):
    if "mode" in params:
        return "jaxdet.log_softmax" if params["mode"] == _MODES["log_softmax"] else "jaxdet.softmax"
    if "op" in params:
        return "jaxdet's det_math"
    if "log_prob" in params and params["log_prob"]:
        return "jaxdet.label_log_probs"
    return "jaxdet.softmax_cross_entropy"


# Reached only by differentiating an internal kernel directly (every primitive the public
# functions bind under a derivative has a rule above).
autodiff.refuse_jvp(globals(), _softmax_public, lambda public: f"{public}: this derivative is not supported")

# The public functions carry their constants (jaxdet.softmax.SEGMENT, ...).
for _fn in (softmax, log_softmax, softmax_cross_entropy, softmax_cross_entropy_with_integer_labels, label_log_probs):
    _fn.SEGMENT = SEGMENT
