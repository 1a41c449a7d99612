"""`lax.dot_general` with any dimension numbers on jaxdet's GEMM kernels, by the chunk rule.

The rule (docs/invariant.md): the contracted index k (the contracting dimensions flattened in the
order the dimension numbers list them) is cut into chunks of ``GEMM_CHUNK``; each output
element folds its chunk in ascending k in float32 from 0, and the chunk partials are combined by
the canonical tree, in float32, cast once. Row bits never depend on other rows; appending zeros
to the contracted dimension changes no bit; pieces of 2^j whole chunks combined by the tree
reproduce the whole.

How it runs: the operands are brought to ``[L, M, K]`` / ``[L, K, N]`` and read as they lie
where a kernel can: ``lhs [L, K, M]`` with ``rhs [L, K, N]`` (the weight-gradient layout, tokens
contracted) is the chunk-tree weight-gradient product; ``rhs [L, N, K]`` is the forward kernel
reading it transposed. Otherwise one transposed copy. Every kernel applies the chunk rule itself.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import checks
from jaxdet._src.matmul.matmul import (
    SUPPORTED_DTYPES,
    _product,
    _weight_grad3,
)


def _is_identity(perm):
    return tuple(perm) == tuple(range(len(perm)))


def _arrange(x, batch, first, second):
    """x with dims (batch, first, second) as [L, F, S] (one transposed copy unless they lie so)."""
    perm = tuple(batch) + tuple(first) + tuple(second)
    shape = x.shape
    L = math.prod(shape[d] for d in batch)
    F = math.prod(shape[d] for d in first)
    S = math.prod(shape[d] for d in second)
    if not _is_identity(perm):
        x = jnp.transpose(x, perm)
    return x.reshape(L, F, S)


def dot_general(lhs, rhs, dimension_numbers, preferred_element_type=None):
    """``lax.dot_general(lhs, rhs, dimension_numbers, preferred_element_type=...)`` by the chunk rule.

    Float32, bfloat16 or float16 operands of one dtype; the result has preferred_element_type
    (None: the operands' dtype; float32 allowed for bf16/f16). Differentiable in reverse mode
    (the products' own rules: dA row invariant, dB by the chunk tree).
    """
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = tuple(lc), tuple(rc), tuple(lb), tuple(rb)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    if lhs.dtype != rhs.dtype:
        raise TypeError(
            f"dot_general operands must have one dtype, got {lhs.dtype} and {rhs.dtype}; cast one explicitly"
        )
    dtype = np.dtype(lhs.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"dot_general of {dtype.name} operands has no jaxdet kernel (float32, bfloat16 and float16 do)")
    out_dtype = checks.accumulated_result_dtype(dtype, preferred_element_type, "preferred_element_type")
    lf = tuple(d for d in range(lhs.ndim) if d not in lc + lb)
    rf = tuple(d for d in range(rhs.ndim) if d not in rc + rb)
    batch_shape = tuple(lhs.shape[d] for d in lb)
    lf_shape = tuple(lhs.shape[d] for d in lf)
    out_shape = batch_shape + lf_shape + tuple(rhs.shape[d] for d in rf)
    K = math.prod(lhs.shape[d] for d in lc)
    if math.prod(out_shape) == 0 or K == 0:
        return jnp.zeros(out_shape, out_dtype)
    # The weight-gradient layout: both operands hold the contracted (token) dimension first after
    # the batch; the chunk-tree product reads them as they lie.
    if _is_identity(lb + lc + lf) and _is_identity(rb + rc + rf):
        out = _weight_grad3(_arrange(lhs, lb, lc, lf), _arrange(rhs, rb, rc, rf), out_dtype)
        return out.reshape(out_shape)
    # rhs as [.., N, K] (read transposed in place) when that is how it lies, else [.., K, N].
    transpose_b = _is_identity(rb + rf + rc) and not _is_identity(rb + rc + rf)
    b3 = _arrange(rhs, rb, rf, rc) if transpose_b else _arrange(rhs, rb, rc, rf)
    if not lb:
        # Shared weights: lhs keeps its free dims as rows (a split of any of them stays local
        # under sharding), the contracted dims flattened last.
        perm = lf + lc
        a = lhs if _is_identity(perm) else jnp.transpose(lhs, perm)
        a = a.reshape(lf_shape + (K,))
        return _product(a, b3[0], out_dtype, transpose_b, True).reshape(out_shape)
    a3 = _arrange(lhs, lb, lf, lc)
    return _product(a3, b3, out_dtype, transpose_b, False).reshape(out_shape)


__all__ = ["dot_general"]
