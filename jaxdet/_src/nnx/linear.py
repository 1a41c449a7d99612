"""``dot_general``, ``DotGeneral`` (for linen's ``dot_general_cls``), ``Linear`` and ``Embed``.

Each module subclasses flax's own, so the constructor, the parameter names, shapes, dtypes and
initializers are flax's, and a flax checkpoint loads unchanged; only ``__call__`` (and
``Embed.attend``) run jaxdet's ops: the product by the chunk rule (row invariant, the weight
gradient by the canonical tree), the bias through ``jaxdet.bias_add`` (its gradient the canonical
sum over tokens) and the lookup through ``jaxdet.embed`` (its table gradient ``segment_sum``).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

import jaxdet
from jaxdet._src.matmul.dot_general import dot_general as _chunk_rule_dot_general

__all__ = ["dot_general", "DotGeneral", "Linear", "Embed"]


def _is_precision(p):
    if p is None or isinstance(p, lax.Precision):
        return True
    if isinstance(p, str):
        try:
            lax.Precision(p)
        except ValueError:
            return False
        return True
    return False


def _check_precision(precision):
    # Every precision gives the same result: jaxdet's products accumulate in float32 and take
    # float32 operands as they are (never TF32 or bfloat16 passes), which meets the highest. A dot
    # algorithm (lax.DotAlgorithmPreset) asks for other arithmetic, so it is refused.
    pair = isinstance(precision, (tuple, list)) and len(precision) == 2
    if (pair and all(_is_precision(p) for p in precision)) or _is_precision(precision):
        return
    raise TypeError(
        "precision must be None, a jax.lax.Precision (or its name) or a pair of them (jaxdet's products "
        f"accumulate in float32 whatever the precision and take no dot algorithm), got {precision!r}"
    )


def _reshard(out, out_sharding):
    # The result's placement only: resharding moves data and changes no bit.
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
    """``jax.lax.dot_general``'s signature on jaxdet's GEMM kernels, by the chunk rule.

    Pass it where flax takes a ``dot_general`` (``nnx.Linear``, ``nnx.LinearGeneral``,
    ``nnx.MultiHeadAttention``'s ``qkv_dot_general`` / ``out_dot_general``, linen's ``nn.Dense``).
    Operands: float32, bfloat16 or float16, of one dtype; any dimension numbers. The contracted
    index is folded in ascending order in float32 in chunks of ``jaxdet.GEMM_CHUNK``
    combined by the canonical tree (docs/invariant.md), so an output row's bits depend on that row
    only; the weight gradient is the canonical tree over tokens. ``precision`` is checked and
    every value gives this result (float32 accumulation of the operands as given, never TF32);
    ``out_sharding`` reshards the result.
    """
    _check_precision(precision)
    out = _chunk_rule_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)
    return _reshard(out, out_sharding)


class DotGeneral:
    """``dot_general`` as a class, for linen's ``nn.Dense(..., dot_general_cls=jaxdet.nnx.DotGeneral)``."""

    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
        return dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type, out_sharding)


def add_bias(y, bias):
    """``y + bias`` over the last axis in their promoted dtype, the bias gradient by the canonical sum."""
    dtype = jnp.result_type(y, bias)
    return jaxdet.bias_add(jnp.asarray(y, dtype), jnp.asarray(bias, dtype))


class Linear(nnx.Linear):
    """``flax.nnx.Linear`` on jaxdet's ops: the same arguments, parameters (``kernel [in, out]``,
    ``bias [out]``) and dtypes; ``dot_general`` defaults to :func:`dot_general` and the bias is
    added by ``jaxdet.bias_add``. Outputs equal flax's to rounding; a row of the output depends on
    that row of the input only, and the gradients of ``kernel`` and ``bias`` are canonical sums
    over tokens."""

    def __init__(self, *args, dot_general=dot_general, **kwargs):
        super().__init__(*args, dot_general=dot_general, **kwargs)

    def __call__(self, inputs, out_sharding=None):
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        kwargs = {"out_sharding": out_sharding}
        if self.preferred_element_type is not None:
            kwargs["preferred_element_type"] = self.preferred_element_type
        y = self.dot_general(inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision, **kwargs)
        if bias is not None:
            y = add_bias(y, bias)
        return y


def _signature_with_default(init, name, default):
    # flax's constructor signature (for help() and IDEs), with this module's default for `name`.
    sig = inspect.signature(init)
    params = [p.replace(default=default) if p.name == name else p for p in sig.parameters.values()]
    return sig.replace(parameters=params)


Linear.__init__.__signature__ = _signature_with_default(nnx.Linear.__init__, "dot_general", dot_general)


class Embed(nnx.Embed):
    """``flax.nnx.Embed`` on jaxdet's ops: the same arguments and ``embedding [num_embeddings,
    features]`` parameter. The lookup is ``jaxdet.embed`` (``jnp.take``'s values: negative ids
    count from the end, other ids out of range give NaN rows; with one embedding every id reads
    it, as in flax), whose table gradient is ``jaxdet.segment_sum``'s canonical order;
    ``attend`` is :func:`dot_general` against the table read in place."""

    def __call__(self, inputs, out_sharding=None):
        if not jnp.issubdtype(inputs.dtype, jnp.integer):
            raise ValueError("Input type must be an integer or unsigned integer.")
        (embedding,) = self.promote_dtype((self.embedding[...],), dtype=self.dtype, inexact=False)
        if self.num_embeddings == 1:
            inputs = jnp.zeros_like(inputs)  # flax broadcasts the single row whatever the id
        return _reshard(jaxdet.embed(embedding, inputs), out_sharding)

    def attend(self, query, out_sharding=None):
        query, embedding = self.promote_dtype((query, self.embedding[...]), dtype=self.dtype)
        return dot_general(query, embedding, (((query.ndim - 1,), (1,)), ((), ())), out_sharding=out_sharding)
