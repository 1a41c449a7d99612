"""Batch-invariant RMSNorm and LayerNorm, bitwise equal on CPU and GPU.

The contracts (docs/norm.md, proven by tests/test_norm.py):

* Row invariance, forward and backward: a row's output and input gradient depend only on that row,
  the parameters (and, backward, that row's cotangent); every row is reduced over its features in
  the canonical span order (cuda/common/det_math.h), whatever the number of rows.
* CPU == GPU bitwise: the same float32 operations in the same order on both backends.
* Parameter gradients: dscale = sum over tokens of g * xhat and dbias = sum of g, by the canonical
  balanced tree over tokens (jaxdet.parallel.tree_sum's tree, one token per leaf), so a device that
  holds an aligned power-of-two block of tokens holds a subtree.
* Derivatives: the tangent is a linear map transposed by the backward kernels; second derivatives
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

__all__ = ["rms_norm", "layer_norm", "GRAD_BLOCK_TOKENS"]

# Tokens per partial that the parameter-gradient kernels write (an aligned subtree of the tree over
# tokens; cuda/norm/norm_math.h kGradBlock). The upper levels of the tree combine the partials.
GRAD_BLOCK_TOKENS = 32

_F32 = np.dtype(jnp.float32)


# ---- Primitive 1: jaxdet_norm_fwd. x [G, R, n], w f32 [1 or G, n], b f32 [1 or G, n] or [0]
# -> y [G, R, n] (x's dtype), stats f32 [G, R, 2] = (mean, rstd). ----


def _fwd_abstract_eval(x, w, b, *, eps, center):
    return (ffi.shaped(x.shape, x.dtype), ffi.shaped(x.shape[:2] + (2,), _F32))


def _fold_groups(args, dims, row_args):
    """Brings the vmapped axis to the front and folds it into G. `row_args[i]` says whether
    argument i is shaped like x ([G, R, ...]); the others are parameters [Gp, n] (Gp in {1, G}),
    kept shared when unbatched with Gp == 1 (or empty), else broadcast to [B * G, n]."""
    size = batching.batch_size(args, dims)
    moved = [batching.moved_to_front(a, d, size) if is_row else a for a, d, is_row in zip(args, dims, row_args)]
    G = next(a.shape[1] for a, is_row in zip(moved, row_args) if is_row)
    out = []
    for a, d, is_row in zip(moved, dims, row_args):
        if not is_row and (a.size == 0 or (batching.not_mapped(d) and a.shape[0] == 1)):
            out.append(a)
            continue
        full = a if is_row else jnp.broadcast_to(batching.moved_to_front(a, d, size), (size, G) + a.shape[-1:])
        out.append(full.reshape((size * full.shape[1],) + full.shape[2:]))
    return size, out


def _fwd_batch(args, dims, *, eps, center):
    size, (x, w, b) = _fold_groups(args, dims, (True, False, False))
    y, stats = norm_fwd_p.bind(x, w, b, eps=eps, center=center)
    return (batching.unfold(y, size), batching.unfold(stats, size)), (0, 0)


norm_fwd_p = ffi.define_primitive(
    "jaxdet_norm_fwd",
    _fwd_abstract_eval,
    attributes=lambda eps, center: dict(eps=np.float32(eps), center=bool(center)),
    batching_rule=_fwd_batch,
    multiple_results=True,
)


# ---- Primitive 2: jaxdet_norm_bwd. x, w, stats, g -> dx [G, R, n]. ----


def _bwd_abstract_eval(x, w, stats, g, *, center):
    return ffi.shaped(x.shape, x.dtype)


def _bwd_batch(args, dims, *, center):
    size, (x, w, stats, g) = _fold_groups(args, dims, (True, False, True, True))
    return batching.unfold(norm_bwd_p.bind(x, w, stats, g, center=center), size), 0


norm_bwd_p = ffi.define_primitive(
    "jaxdet_norm_bwd",
    _bwd_abstract_eval,
    attributes=lambda center: dict(center=bool(center)),
    batching_rule=_bwd_batch,
)


# ---- Primitive 3: jaxdet_norm_param_grad. x [G, T, n], stats [G, T, 2], g [G, T, n] -> dscale
# f32 [G, n], dbias f32 [G, n] ([G, 0] without a bias): per group, the canonical tree over its T
# tokens; then the CUDA kernels' workspaces for the partials between the levels of that tree
# (aligned runs of GRAD_BLOCK_TOKENS tokens, then of as many partials, ...). ----


def _grad_workspace_rows(tokens):
    """Rows of partials between the levels of the tree (norm_math.h grad_workspace_rows)."""
    rows, count = 0, -(-tokens // GRAD_BLOCK_TOKENS)
    while count > 1:
        rows += count
        count = -(-count // GRAD_BLOCK_TOKENS)
    return rows


def _pg_abstract_eval(x, stats, g, *, has_bias):
    G, T, n = x.shape
    ws = _grad_workspace_rows(T)
    return (
        ffi.shaped((G, n), _F32),
        ffi.shaped((G, n if has_bias else 0), _F32),
        ffi.shaped((G, ws, n), _F32),
        ffi.shaped((G, ws if has_bias else 0, n), _F32),
    )


def _pg_batch(args, dims, *, has_bias):
    size, flat = _fold_groups(args, dims, (True, True, True))
    outs = norm_param_grad_p.bind(*flat, has_bias=has_bias)
    return [batching.unfold(o, size) for o in outs], [0, 0, 0, 0]


norm_param_grad_p = ffi.define_primitive(
    "jaxdet_norm_param_grad",
    _pg_abstract_eval,
    attributes=lambda has_bias: {},
    batching_rule=_pg_batch,
    multiple_results=True,
)


# ---- Composite primitives on the rows as the user shaped them, x [*R, n] (every leading dimension a
# row dimension), so that under sharded jit a split of any row dimension stays on its device with no
# collective (each device flattens its own shard); the features n are never split (a row's reduction
# must see the whole row: a split n is all-gathered). ----


def _row_factors(x_shape):
    return tuple(f"r{i}" for i in range(len(x_shape) - 1))


def _as_groups(x):
    return x.reshape(1, -1, x.shape[-1])


def _rows_fwd_abstract_eval(x, w, b, *, eps, center, has_bias):
    return (ffi.shaped(x.shape, x.dtype), ffi.shaped(x.shape[:-1] + (2,), _F32))


def _rows_fwd_local(params, axes, shapes):
    def run(x, w, b):
        bias = b.reshape(1, -1) if params["has_bias"] else jnp.zeros((0,), _F32)
        y, stats = norm_fwd_p.bind(_as_groups(x), w.reshape(1, -1), bias, eps=params["eps"], center=params["center"])
        return y.reshape(x.shape), stats.reshape(x.shape[:-1] + (2,))

    return run


def _rows_fwd_factors(params, shapes):
    rows = _row_factors(shapes[0])
    return [rows + ("n",), ("n",), ("n",)], [rows + ("n",), rows + ("two",)]


def _param_batched(args, dims, which):
    return any(not batching.not_mapped(dims[i]) for i in which)


def _rows_fwd_batch(args, dims, *, eps, center, has_bias):
    (x, w, b), (xd, wd, bd) = args, dims
    if not _param_batched(args, dims, (1, 2)):  # the vmapped axis is one more row dimension
        return norm_rows_fwd_p.bind(jnp.moveaxis(x, xd, 0), w, b, eps=eps, center=center, has_bias=has_bias), (0, 0)
    # Per-example parameters: one group per example (the kernels' [G, R, n] layout).
    size = batching.batch_size(args, dims)
    x = batching.moved_to_front(x, xd, size)
    w, b = batching.moved_to_front(w, wd, size), batching.moved_to_front(b, bd, size)
    y, stats = norm_fwd_p.bind(
        x.reshape(size, -1, x.shape[-1]), w, b if has_bias else jnp.zeros((0,), _F32), eps=eps, center=center
    )
    return (y.reshape(x.shape), stats.reshape(x.shape[:-1] + (2,))), (0, 0)


norm_rows_fwd_p = ffi.define_composite(
    "jaxdet_norm_rows_fwd",
    _rows_fwd_abstract_eval,
    ffi.Partitioning(_rows_fwd_factors, replicated=frozenset({"n", "two"}), local=_rows_fwd_local),
    batching_rule=_rows_fwd_batch,
    multiple_results=True,
)


def _rows_bwd_abstract_eval(x, w, stats, g, *, center):
    return ffi.shaped(x.shape, x.dtype)


def _rows_bwd_local(params, axes, shapes):
    def run(x, w, stats, g):
        dx = norm_bwd_p.bind(
            _as_groups(x), w.reshape(1, -1), stats.reshape(1, -1, 2), _as_groups(g), center=params["center"]
        )
        return dx.reshape(x.shape)

    return run


def _rows_bwd_factors(params, shapes):
    rows = _row_factors(shapes[0])
    return [rows + ("n",), ("n",), rows + ("two",), rows + ("n",)], [rows + ("n",)]


def _rows_bwd_batch(args, dims, *, center):
    (x, w, stats, g), (xd, wd, sd, gd) = args, dims
    size = batching.batch_size(args, dims)
    x, stats, g = (batching.moved_to_front(a, d, size) for a, d in ((x, xd), (stats, sd), (g, gd)))
    if batching.not_mapped(wd):
        return norm_rows_bwd_p.bind(x, w, stats, g, center=center), 0
    w = jnp.moveaxis(w, wd, 0)
    grouped = lambda a: a.reshape(size, -1, a.shape[-1])
    dx = norm_bwd_p.bind(grouped(x), w, grouped(stats), grouped(g), center=center)
    return dx.reshape(x.shape), 0


norm_rows_bwd_p = ffi.define_composite(
    "jaxdet_norm_rows_bwd",
    _rows_bwd_abstract_eval,
    ffi.Partitioning(_rows_bwd_factors, replicated=frozenset({"n", "two"}), local=_rows_bwd_local),
    batching_rule=_rows_bwd_batch,
)


# ---- The parameter gradients as one composite: tokens x [T, n], stats [T, 2], g [T, n] -> dscale
# [n] (and dbias [n]) in float32, the canonical tree over tokens. With the tokens split over devices
# each device reduces its own tokens (a subtree when it holds a power-of-two count, which is when the
# split is allowed) and the devices' roots are combined by the top levels of the same tree
# (tree_psum: data movement, no psum); the features may be split with no collective. ----


def _grads_abstract_eval(x, stats, g, *, has_bias):
    return [ffi.shaped(x.shape[-1:], _F32)] * (2 if has_bias else 1)


def _grads_of(x3, stats3, g3, has_bias):
    """Per group [G, n]: the canonical tree over the group's tokens."""
    dw, db, _, _ = norm_param_grad_p.bind(x3, stats3, g3, has_bias=has_bias)
    return [dw] + ([db] if has_bias else [])


def _grads_local(params, axes, shapes):
    tokens = axes.get("t", ())

    def run(x, stats, g):
        out = [o[0] for o in _grads_of(x[None], stats[None], g[None], params["has_bias"])]
        return [tree.tree_psum_untyped(o, tokens) for o in out] if tokens else out

    return run


def _grads_factors(params, shapes):
    return [("t", "n"), ("t", "two"), ("t", "n")], [("n",)] * (2 if params["has_bias"] else 1)


def _grads_batch(args, dims, *, has_bias):
    size = batching.batch_size(args, dims)
    x, stats, g = (batching.moved_to_front(a, d, size) for a, d in zip(args, dims))
    return _grads_of(x, stats, g, has_bias), [0] * (2 if has_bias else 1)


# A split of the reduced dimension only along whole subtrees of its chunk tree.
_TOKEN_SPLIT = tree.whole_chunk_split("t", 1)
norm_grads_p = ffi.define_composite(
    "jaxdet_norm_param_grads",
    _grads_abstract_eval,
    ffi.Partitioning(
        _grads_factors,
        replicated=frozenset({"two"}),
        reduced=frozenset({"t"}),
        local=_grads_local,
        can_split=_TOKEN_SPLIT,
    ),
    batching_rule=_grads_batch,
    multiple_results=True,
)


# ---- The differentiable core: x [..., n], w and b float32 [n].
#
# The tangent of y is linear in (tx, tw, tb): w * S tx + xhat * tw + tb, where S = rstd (I - xhat
# xhatᵀ / n) (LayerNorm: also minus the mean, rstd (I - 11ᵀ/n - xhat xhatᵀ / n)) is symmetric, so
# S tx is the backward kernel with a weight of ones. Its transpose in (tx, tw, tb) is the backward
# itself: dx = the backward kernel (S (w * g)), dscale and dbias the canonical trees over tokens
# (`_norm_transpose`), so reverse mode runs exactly those kernels. The derivatives of the kernels
# themselves (second order) are those of their formulas written with jaxdet.sum over the features
# or the tokens (`_stats_tangent`, `_bwd_formula`, `_grads_formula`). ----


def _row_sum(v):
    return canonical_sum(v, axis=-1)


def _xhat(x, stats):
    """(x - mean) * rstd in float32, from the row statistics (the forward's xhat, elementwise)."""
    return (x.astype(_F32) - stats[..., :1]) * stats[..., 1:]


def _norm_transpose(x, w, b, center, has_bias, which):
    """The transpose of the tangent map in the tangents named by `which` (a subset of "x", "w", "b")."""
    vmas = {k: varying.varying_axes(v) for k, v in (("x", x), ("w", w), ("b", b))}

    def transpose(x, w, stats, g):
        out = []
        if "x" in which:
            # Under shard_map, a parameter invariant over axes the activations vary over gets the
            # canonical-tree sum of the devices' gradients (match_varying: tree_psum, never psum).
            out.append(tree.match_varying(norm_rows_bwd_p.bind(x, w, stats, g, center=center), vmas["x"]))
        if "w" in which or "b" in which:
            n = x.shape[-1]
            grads = norm_grads_p.bind(x.reshape(-1, n), stats.reshape(-1, 2), g.reshape(-1, n), has_bias=has_bias)
            if "w" in which:
                out.append(tree.match_varying(grads[0], vmas["w"]))
            if "b" in which:
                out.append(tree.match_varying(grads[1], vmas["b"]))
        return tuple(out)

    return transpose


def _norm_tangent(x, w, b, stats, tangents, center, has_bias):
    """w * S tx + xhat * tw + tb (the tangents that are None are zero), as a `linear_call`."""
    which = tuple(k for k, t in zip("xwb", tangents) if t is not None)
    lin = tuple(t for t in tangents if t is not None)

    def fn(x, w, stats, *lin):
        t = dict(zip(which, lin))
        acc = []
        if "x" in t:
            ones = jnp.ones_like(w)
            acc.append(w * norm_rows_bwd_p.bind(x, ones, stats, t["x"], center=center).astype(_F32))
        if "w" in t:
            acc.append(_xhat(x, stats) * t["w"])
        if "b" in t:
            acc.append(jnp.broadcast_to(t["b"], x.shape))
        return (autodiff.rounded_sum(acc).astype(x.dtype),)

    return autodiff.linear_call(fn, _norm_transpose(x, w, b, center, has_bias, which), (x, w, stats), lin)[0]


def _stats_formula(x, *, eps, center):
    """(mean, rstd) of docs/norm.md's formulas, with jaxdet.sum over the features: differentiated
    for the statistics' tangent (its value is not used)."""
    n = x.shape[-1]
    xf = x.astype(_F32)
    mean = _row_sum(xf) / n if center else jnp.zeros(x.shape[:-1], _F32)
    xc = xf - mean[..., None]
    rstd = jax.lax.rsqrt(_row_sum(xc * xc) / n + np.float32(eps))
    return jnp.stack([mean, rstd], axis=-1)


def _fwd_jvp(primals, tangents, *, eps, center, has_bias):
    x, w, b = primals
    y, stats = norm_rows_fwd_p.bind(x, w, b, eps=eps, center=center, has_bias=has_bias)
    present = tuple(None if type(t) is ad.Zero else t for t in tangents)
    if all(t is None for t in present):
        return (y, stats), [autodiff.zero_tangent(y), autodiff.zero_tangent(stats)]
    ty = _norm_tangent(x, w, b, stats, present, center, has_bias)
    if present[0] is None:
        tstats = autodiff.zero_tangent(stats)
    else:
        # Through jax.jvp, so that jaxdet.sum's own derivative rule makes the tangent a linear map.
        tstats = jax.jvp(lambda x: _stats_formula(x, eps=eps, center=center), (x,), (present[0],))[1]
    return (y, stats), [ty, tstats]


def _bwd_formula(x, w, stats, g, *, center):
    n = x.shape[-1]
    xhat, gw = _xhat(x, stats), g.astype(_F32) * w
    mb = _row_sum(gw * xhat)[..., None] / n
    if center:
        ma = _row_sum(gw)[..., None] / n
        return stats[..., 1:] * ((gw - xhat * mb) - ma)
    return stats[..., 1:] * (gw - xhat * mb)


def _grads_formula(x, stats, g, *, has_bias):
    gf = g.astype(_F32)
    dw = canonical_sum(gf * _xhat(x, stats), axis=0)
    return [dw, canonical_sum(gf, axis=0)] if has_bias else [dw]


# The kernels on groups [G, R, n] with parameters [1 or G, n], which the batching rules bind for
# per-example parameters: only second and higher derivatives reach them, through their formulas.


def _grouped_fwd_formula(x, w, b, *, eps, center):
    stats = _stats_formula(x, eps=eps, center=center)
    y = _xhat(x, stats) * w[:, None, :]
    return [y + b[:, None, :] if b.size else y, stats]


def _grouped_bwd_formula(x, w, stats, g, *, center):
    return _bwd_formula(x, w[:, None, :], stats, g, center=center)


def _grouped_grads_formula(x, stats, g, *, has_bias):
    gf = g.astype(_F32)
    dw = canonical_sum(gf * _xhat(x, stats), axis=1)
    db = canonical_sum(gf, axis=1) if has_bias else jnp.zeros((x.shape[0], 0), _F32)
    ws = _pg_abstract_eval(x, stats, g, has_bias=has_bias)[2:]
    return [dw, db] + [jnp.zeros(a.shape, a.dtype) for a in ws]  # the workspaces: no tangent


ad.primitive_jvps[norm_rows_fwd_p] = _fwd_jvp
autodiff.jvp_of_formula(norm_rows_bwd_p, _bwd_formula)
autodiff.jvp_of_formula(norm_grads_p, _grads_formula)
autodiff.jvp_of_formula(norm_fwd_p, _grouped_fwd_formula)
autodiff.jvp_of_formula(norm_bwd_p, _grouped_bwd_formula)
autodiff.jvp_of_formula(norm_param_grad_p, _grouped_grads_formula)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5))
def _norm(x, w, b, eps, center, has_bias):
    return norm_rows_fwd_p.bind(x, w, b, eps=eps, center=center, has_bias=has_bias)[0]


def _norm_jvp(eps, center, has_bias, primals, tangents):
    x, w, b = primals
    y, stats = norm_rows_fwd_p.bind(x, w, b, eps=eps, center=center, has_bias=has_bias)
    present = tuple(None if autodiff.is_zero(t) else t for t in tangents)
    if all(t is None for t in present):
        return y, jnp.zeros_like(y)
    return y, _norm_tangent(x, w, b, stats, present, center, has_bias)


_norm.defjvp(_norm_jvp, symbolic_zeros=True)


def _check_param(p, name, n):
    p = checks.check_float_array(p, name)
    if p.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},) (the last dimension of x), got {tuple(p.shape)}")
    return p


def _apply(x, scale, bias, eps, center):
    x = checks.check_float_array(x, "x")
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension (the features are its last axis), got a scalar")
    n = x.shape[-1]
    scale = _check_param(scale, "scale", n) if scale is not None else None
    bias = _check_param(bias, "bias", n) if bias is not None else None
    eps = checks.check_eps(eps)
    if x.size == 0:
        return tree.match_varying(jnp.zeros(x.shape, x.dtype), varying.varying_axes(x))
    # Parameters enter the kernels as float32 (exact widening); their gradients come back as
    # float32 tree sums and are rounded once to the parameter dtype by the astype's transpose.
    w = jnp.ones((n,), _F32) if scale is None else scale.astype(_F32)
    b = jnp.zeros((n,), _F32) if bias is None else bias.astype(_F32)
    return _norm(x, w, b, eps, center, bias is not None)


def rms_norm(x, scale, eps: float = 1e-6):
    """RMSNorm over the last axis: ``y = x * rstd * scale``, ``rstd = 1 / sqrt(mean(x^2) + eps)``.

    Args:
      x: ``[..., n]`` float32, bfloat16 or float16 (every leading index is a token).
      scale: ``[n]`` float32, bfloat16 or float16, or None (no scale: ones).
      eps: a static Python float >= 0, added to the mean square in float32.

    Returns ``y`` with x's shape and dtype. Statistics and arithmetic are float32 (x and scale
    widened exactly), each operation rounded once, in the order of docs/norm.md; y is rounded once
    to x's dtype. A row's bits depend only on that row and ``scale``, and equal on CPU and GPU.
    Differentiable to any order, forward and reverse (docs/derivatives.md): dx and the tangent are
    row-invariant too; dscale is the canonical tree over tokens of ``g * xhat`` in float32, rounded
    once to scale's dtype.
    """
    return _apply(x, scale, None, eps, center=False)


def layer_norm(x, scale, bias, eps: float = 1e-6):
    """LayerNorm over the last axis: ``y = (x - mean) * rstd * scale + bias``,
    ``rstd = 1 / sqrt(mean((x - mean)^2) + eps)`` (two-pass variance).

    Args:
      x: ``[..., n]`` float32, bfloat16 or float16.
      scale, bias: ``[n]`` float32, bfloat16 or float16, or None (no scale / no bias).
      eps: a static Python float >= 0.

    The same contracts as :func:`rms_norm`; dbias is the canonical tree over tokens of ``g``.
    """
    return _apply(x, scale, bias, eps, center=True)


# The public functions carry their constants (jaxdet.rms_norm.GRAD_BLOCK_TOKENS, ...).
rms_norm.GRAD_BLOCK_TOKENS = layer_norm.GRAD_BLOCK_TOKENS = GRAD_BLOCK_TOKENS
