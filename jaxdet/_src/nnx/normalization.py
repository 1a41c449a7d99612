"""``LayerNorm`` and ``RMSNorm``: flax's modules with jaxdet's normalization.

Over the last axis with no ``mask`` (the common case) a norm is one ``jaxdet.layer_norm`` /
``jaxdet.rms_norm`` kernel: a row's bits depend on that row and the parameters only, and the
parameter gradients are the canonical tree over tokens. Other ``reduction_axes`` /
``feature_axes`` and a ``mask=`` take the general path (``_general_norm``): float32 arithmetic in
which every reduction is a canonical ``jaxdet.sum`` and every product that meets an add is rounded
on its own, forward and backward, keeping the same two properties. The variance is two-pass in
both (``use_fast_variance`` is accepted and gives the two-pass variance: more accurate, equal to
flax's to rounding).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as flax_dtypes

import jaxdet
from jaxdet._src.core import varying

__all__ = ["LayerNorm", "RMSNorm"]

_F32 = jnp.float32
_KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _axes(ndim, axes, name):
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    out = []
    for a in axes:
        if not isinstance(a, int) or not -ndim <= a < ndim:
            raise ValueError(f"{name} entry {a!r} is not an axis of an input of rank {ndim}")
        out.append(a % ndim)
    return tuple(sorted(set(out)))


def _as_varying_as(grad, param):
    """Inside ``jax.shard_map``, a parameter's gradient summed over the mesh axes the activations vary
    over and the parameter does not, by the canonical tree (``jaxdet.parallel.tree_psum``)."""
    axes = varying.varying_axes(grad) - varying.varying_axes(param)
    return jaxdet.parallel.tree_psum(grad, varying.mesh_order(axes)) if axes else grad


def _feature_shape(x, feature_axes):
    return tuple(x.shape[a] if a in feature_axes else 1 for a in range(x.ndim))


def _rounded(x):
    """x (float32) stored rounded: its bits pass through an xor with a zero that exists only at run
    time (the sum of one +0 by ``jaxdet.sum``, a custom call), which no compiler sees through. XLA:CPU
    contracts a multiply and an add of one fused loop into an FMA, and rewrites ``1 / sqrt`` into
    ``rsqrt``; each operand passed through here keeps its own rounding, so the bits do not depend on
    fusion (jit or eager, the program's shapes)."""
    zero = jax.lax.bitcast_convert_type(jaxdet.sum(jnp.zeros((1,), _F32)), jnp.uint32)
    return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) ^ zero, _F32)


# The general path: float32 arithmetic, every reduction a canonical jaxdet.sum (over the reduction
# axes for the statistics and their backward, over the tokens for the parameter gradients), every
# product that meets an add rounded on its own. The backward is written out (custom_vjp) so that no
# broadcast's transpose becomes an XLA reduction.


def _statistics(xf, keep, eps, center, reduction):
    def over_rows(t):
        return jaxdet.sum(t if keep is None else jnp.where(keep, t, 0.0), axis=reduction, keepdims=True)

    if keep is None:
        count = jnp.float32(math.prod(xf.shape[a] for a in reduction))
    else:
        count = over_rows(jnp.ones(xf.shape, _F32))
    count = _rounded(count)
    d = xf - over_rows(xf) / count if center else xf
    var = over_rows(d * d) / count
    rstd = 1.0 / _rounded(jnp.sqrt(var + jnp.float32(eps)))
    return d, rstd, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _general_norm(x, scale, bias, keep, eps, center, reduction, features):
    return _general_norm_fwd(x, scale, bias, keep, eps, center, reduction, features)[0]


def _general_norm_fwd(x, scale, bias, keep, eps, center, reduction, features):
    shape = _feature_shape(x, features)
    d, rstd, count = _statistics(x.astype(_F32), keep, eps, center, reduction)
    xhat = d * rstd
    y = xhat if scale is None else xhat * scale.astype(_F32).reshape(shape)
    if bias is not None:
        y = _rounded(y) + bias.astype(_F32).reshape(shape)
    return y, (x, scale, bias, keep, d, rstd, count, xhat)


def _general_norm_bwd(eps, center, reduction, features, res, g):
    x, scale, bias, keep, d, rstd, count, xhat = res
    shape = _feature_shape(x, features)
    tokens = tuple(a for a in range(x.ndim) if a not in features)

    def over_rows(t):
        return jaxdet.sum(t, axis=reduction, keepdims=True)

    def over_tokens(t, p):  # a parameter's gradient: the canonical sum over the non-feature axes
        return _as_varying_as(jaxdet.sum(t, axis=tokens), p).reshape(p.shape).astype(p.dtype)

    gw = g if scale is None else g * scale.astype(_F32).reshape(shape)
    # xhat = d * rstd, rstd = (var + eps)^-1/2, var = sum(keep * d^2) / count (d = x - mean when
    # centred, mean = sum(keep * x) / count).
    drstd = over_rows(gw * d)
    dvar_over_count = (jnp.float32(-0.5) * (rstd * rstd * rstd) * drstd) / count
    kept_d = d if keep is None else jnp.where(keep, d, 0.0)
    dd = _rounded(gw * rstd) + _rounded((jnp.float32(2.0) * dvar_over_count) * kept_d)
    dx = dd
    if center:
        dmean_over_count = -over_rows(dd) / count
        dx = dd + _rounded(dmean_over_count if keep is None else jnp.where(keep, dmean_over_count, 0.0))
    dscale = None if scale is None else over_tokens(g * xhat, scale)
    dbias = None if bias is None else over_tokens(g, bias)
    return dx.astype(x.dtype), dscale, dbias, None


_general_norm.defvjp(_general_norm_fwd, _general_norm_bwd)


def _normalize(x, scale, bias, *, center, eps, reduction_axes, feature_axes, dtype, axis_name, mask):
    if axis_name is not None:
        raise NotImplementedError(
            f"axis_name={axis_name!r}: statistics averaged across devices (lax.pmean) are not supported by "
            "jaxdet.nnx's norms; a norm over the features of each token needs none"
        )
    x = jnp.asarray(x)
    out_dtype = jnp.dtype(flax_dtypes.canonicalize_dtype(x, scale, bias, dtype=dtype))
    reduction = _axes(x.ndim, reduction_axes, "reduction_axes")
    features = _axes(x.ndim, feature_axes, "feature_axes")
    last = (x.ndim - 1,)
    if mask is None and reduction == last and features == last and x.dtype in _KERNEL_DTYPES:
        # One kernel. x keeps its dtype when the result has it; otherwise it is widened to float32
        # (exactly) and the float32 result is rounded once to the result dtype, as flax does.
        x_in = x if out_dtype == x.dtype else x.astype(_F32)
        if center:
            y = jaxdet.layer_norm(x_in, scale, bias, eps=eps)
        else:
            y = jaxdet.rms_norm(x_in, scale, eps=eps)
        return y.astype(out_dtype)
    keep = None if mask is None else jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
    if x.dtype not in _KERNEL_DTYPES:
        x = x.astype(_F32)
    y = _general_norm(x, scale, bias, keep, float(eps), center, reduction, features)
    return y.astype(out_dtype)


def _normalize_as(module, x, scale, bias, *, center, mask):
    """`_normalize` with a flax norm module's configuration (epsilon, axes, dtype, axis_name)."""
    return _normalize(
        x,
        scale,
        bias,
        center=center,
        eps=module.epsilon,
        reduction_axes=module.reduction_axes,
        feature_axes=module.feature_axes,
        dtype=module.dtype,
        axis_name=module.axis_name,
        mask=mask,
    )


class LayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` on jaxdet's ops: the same arguments, parameters (``scale``, ``bias``
    ``[num_features]``) and dtypes, ``mask=`` included; outputs equal flax's to rounding (module
    docstring). ``axis_name`` (statistics across devices) raises NotImplementedError."""

    def __call__(self, x, *, mask=None):
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return _normalize_as(self, x, scale, bias, center=True, mask=mask)


class RMSNorm(nnx.RMSNorm):
    """``flax.nnx.RMSNorm`` on jaxdet's ops: the same arguments, ``scale [num_features]`` and
    dtypes, ``mask=`` included; outputs equal flax's to rounding (module docstring). ``axis_name``
    raises NotImplementedError."""

    def __call__(self, x, mask=None):
        scale = self.scale[...] if self.scale is not None else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        return _normalize_as(self, x, scale, None, center=False, mask=mask)
