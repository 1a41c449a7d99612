"""``LayerNorm`` and ``RMSNorm``: flax's modules with jaxdet's normalization.

Over the last axis with no ``mask`` (the common case) a norm is one ``jaxdet.layer_norm`` /
``jaxdet.rms_norm`` kernel: a row's bits depend on that row and the parameters only, and the
parameter gradients are the canonical tree over tokens. Other ``reduction_axes`` /
``feature_axes`` and a ``mask=`` are computed from canonical sums instead (``jaxdet.sum`` over the
reduction axes for the statistics, and over the tokens for the parameter gradients) with float32
elementwise arithmetic, keeping the same two properties. The variance is two-pass in both
(``use_fast_variance`` is accepted and gives the two-pass variance: more accurate, equal to
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _affine(xhat, scale, bias, feature_axes):
    return _affine_fwd(xhat, scale, bias, feature_axes)[0]


def _feature_shape(x, feature_axes):
    return tuple(x.shape[a] if a in feature_axes else 1 for a in range(x.ndim))


def _affine_fwd(xhat, scale, bias, feature_axes):
    shape = _feature_shape(xhat, feature_axes)
    y = xhat
    if scale is not None:
        y = y * scale.astype(_F32).reshape(shape)
    if bias is not None:
        y = y + bias.astype(_F32).reshape(shape)
    return y, (xhat, scale, bias)


def _affine_bwd(feature_axes, res, g):
    xhat, scale, bias = res
    shape = _feature_shape(xhat, feature_axes)
    tokens = tuple(a for a in range(xhat.ndim) if a not in feature_axes)

    def over_tokens(t, p):  # the canonical sum over every non-feature axis, rounded once to p's dtype
        return _as_varying_as(jaxdet.sum(t, axis=tokens), p).reshape(p.shape).astype(p.dtype)

    dxhat = g if scale is None else g * scale.astype(_F32).reshape(shape)
    dscale = None if scale is None else over_tokens(g * xhat, scale)
    dbias = None if bias is None else over_tokens(g, bias)
    return dxhat, dscale, dbias


_affine.defvjp(_affine_fwd, _affine_bwd)


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
    xf = x.astype(_F32)
    if mask is None:
        count = jnp.float32(math.prod(x.shape[a] for a in reduction))
        keep = None
    else:
        keep = jnp.broadcast_to(jnp.asarray(mask, bool), x.shape)
        count = jaxdet.sum(keep.astype(_F32), axis=reduction, keepdims=True)

    def masked(t):
        return t if keep is None else jnp.where(keep, t, 0.0)

    if center:
        mean = jaxdet.sum(masked(xf), axis=reduction, keepdims=True) / count
        centered = xf - mean
    else:
        centered = xf
    var = jaxdet.sum(masked(centered * centered), axis=reduction, keepdims=True) / count
    rstd = 1.0 / jnp.sqrt(var + jnp.float32(eps))
    y = _affine(centered * rstd, scale, bias, features)
    return y.astype(out_dtype)


class LayerNorm(nnx.LayerNorm):
    """``flax.nnx.LayerNorm`` on jaxdet's ops: the same arguments, parameters (``scale``, ``bias``
    ``[num_features]``) and dtypes, ``mask=`` included; outputs equal flax's to rounding (module
    docstring). ``axis_name`` (statistics across devices) raises NotImplementedError."""

    def __call__(self, x, *, mask=None):
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        x, scale, bias = self.promote_dtype((x, scale, bias), dtype=self.dtype)
        return _normalize(
            x,
            scale,
            bias,
            center=True,
            eps=self.epsilon,
            reduction_axes=self.reduction_axes,
            feature_axes=self.feature_axes,
            dtype=self.dtype,
            axis_name=self.axis_name,
            mask=mask,
        )


class RMSNorm(nnx.RMSNorm):
    """``flax.nnx.RMSNorm`` on jaxdet's ops: the same arguments, ``scale [num_features]`` and
    dtypes, ``mask=`` included; outputs equal flax's to rounding (module docstring). ``axis_name``
    raises NotImplementedError."""

    def __call__(self, x, mask=None):
        scale = self.scale[...] if self.scale is not None else None
        x, scale = self.promote_dtype((x, scale), dtype=self.dtype)
        return _normalize(
            x,
            scale,
            None,
            center=False,
            eps=self.epsilon,
            reduction_axes=self.reduction_axes,
            feature_axes=self.feature_axes,
            dtype=self.dtype,
            axis_name=self.axis_name,
            mask=mask,
        )
