"""NumPy reference of RMSNorm and LayerNorm in the kernels' canonical order (bit-exact; docs/norm.md)."""

from __future__ import annotations

import numpy as np

from jaxdet._src.core.row_reference import F32, as_f32, span_sum, store, token_tree, tree_fold

__all__ = ["F32", "norm_forward", "norm_backward", "store", "token_tree", "tree_fold"]


def norm_forward(x, w, b, eps, center):
    """(y float32 before storage rounding, mean [T], rstd [T])."""
    x = as_f32(x)
    n = x.shape[1]
    nf = F32(n)
    mean = span_sum(x) / nf if center else np.zeros(x.shape[0], F32)
    d = x - mean[:, None]
    rstd = F32(1.0) / np.sqrt(span_sum(d * d) / nf + F32(eps))
    y = (d * rstd[:, None]) * as_f32(w)[None, :]
    if b is not None:
        y = y + as_f32(b)[None, :]
    return y, mean, rstd


def norm_backward(x, w, g, mean, rstd, center):
    """(dx float32, per-token scale terms g * xhat [T, n])."""
    x, g = as_f32(x), as_f32(g)
    nf = F32(x.shape[1])
    xhat = (x - mean[:, None]) * rstd[:, None]
    gw = g * as_f32(w)[None, :]
    mb = span_sum(gw * xhat) / nf
    t = gw - xhat * mb[:, None]
    if center:
        t = t - (span_sum(gw) / nf)[:, None]
    return rstd[:, None] * t, g * xhat
