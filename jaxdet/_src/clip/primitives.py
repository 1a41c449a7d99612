"""The clipping primitives (XLA FFI calls) and their one-device compositions.

Two ways to run the canonical order (docs/clipping.md), with the same kernels and the same bits:

* fused: one native call over all leaves (``jaxdet_clip_global_norm``, ``jaxdet_global_norm``);
* staged: ``jaxdet_clip_partials`` (the chunk slots) -> ``jaxdet_clip_finalize`` (norm and clip
  decision from the slots) -> ``jaxdet_clip_apply`` (scale the leaves by the decision). The stages
  are what vmap (one decision per example), shard_map and sharded jit (the slots of every shard
  gathered into the global order) are built from.

A call whose results alias its leaves costs XLA's fusion pass a time that grows as the cube of
the number of aliased operands (it checks every in-place pair against every operand, for every
operand). So one call aliases at most ``MAX_ALIASED_LEAVES`` leaves: bigger trees are clipped
staged, the apply stage in groups of that many leaves. Every clipped leaf still aliases its input.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import batching, ffi, varying

CHUNK_SIZE = 4096  # elements per chunk (cuda/clip/clip_math.h kChunk)
MAX_ALIASED_LEAVES = 256  # leaves per aliased native call (fused clip, apply groups)


def _size(shape) -> int:
    return math.prod(shape)


def chunks_of(size: int) -> int:
    """Chunk slots of `size` elements: chunks never span leaves, empty leaves have none."""
    return -(-size // CHUNK_SIZE)


def num_chunks(shapes) -> int:
    return sum(chunks_of(_size(s)) for s in shapes)


def f32_aval(shape=()):
    return jax.core.ShapedArray(tuple(shape), jnp.float32)


# ---- Fused primitives: the whole pipeline in one native call ------------------------------------


def _scratch_aval(leaves):
    # Chunk slots, then the clip decision (scale, mode): device memory the kernels hand on.
    return f32_aval((num_chunks([x.shape for x in leaves]) + 2,))


def _global_norm_abstract_eval(*leaves):
    return (f32_aval(), _scratch_aval(leaves))


def _clip_abstract_eval(max_norm, *leaves, nonfinite):
    del max_norm, nonfinite
    return (f32_aval(), _scratch_aval(leaves), *(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves))


# vmap: the staged path, one norm and one decision per example. The scratch result is internal
# (the public functions drop it): a batched placeholder of its shape stands in for it.


def _batched_scratch(norm, leaves):
    return jnp.zeros(norm.shape + (num_chunks([x.shape[1:] for x in leaves]) + 2,), jnp.float32)


def _global_norm_batch(args, dims):
    leaves = batching.to_front(args, dims)[1]
    norm = staged_norm(leaves, batch_dims=1)
    return (norm, _batched_scratch(norm, leaves)), (0, 0)


def _clip_batch(args, dims, *, nonfinite):
    max_norm, *leaves = batching.to_front(args, dims)[1]
    norm, clipped = staged_clip(leaves, max_norm, nonfinite, batch_dims=1)
    return (norm, _batched_scratch(norm, leaves), *clipped), (0,) * (len(clipped) + 2)


def _nonfinite_attributes(nonfinite):
    """The FFI attributes of the calls that take the clip decision (fused clip, finalize)."""
    return dict(nonfinite=np.int32(nonfinite))


global_norm_p = ffi.define_primitive(
    "jaxdet_global_norm",
    _global_norm_abstract_eval,
    attributes=dict,
    batching_rule=_global_norm_batch,
    multiple_results=True,
)

# Operands (max_norm, *leaves); results (norm, scratch, *clipped). Every clipped leaf aliases its
# input buffer, so clipping allocates no gradient-sized buffer (XLA copies only an operand that is
# still live afterwards, e.g. a non-donated jit argument).
clip_p = ffi.define_primitive(
    "jaxdet_clip_global_norm",
    _clip_abstract_eval,
    attributes=_nonfinite_attributes,
    batching_rule=_clip_batch,
    multiple_results=True,
    operand_output_aliases=lambda num_operands: {i: i + 1 for i in range(1, num_operands)},
)


# ---- Staged primitives ------------------------------------------------------------------------
# Every leaf's first `batch_dims` dims are the example dims (the same for all leaves); each example
# is clipped as if it were alone (cuda/clip/clip_ffi.h).


def _batch_shape(leaves, batch_dims):
    shapes = {tuple(x.shape[:batch_dims]) for x in leaves}
    if len(shapes) != 1:
        raise ValueError(f"clip stages: the leaves' leading {batch_dims} (example) dims differ: {sorted(shapes)}")
    return shapes.pop()


def _partials_abstract_eval(*leaves, batch_dims):
    shape = _batch_shape(leaves, batch_dims)
    return f32_aval(shape + (num_chunks([x.shape[batch_dims:] for x in leaves]),))


def _partials_through_abstract_eval(*leaves, batch_dims):
    slots = _partials_abstract_eval(*leaves, batch_dims=batch_dims)
    return (slots, *(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves))


def _finalize_abstract_eval(slots, max_norm, *, nonfinite):
    del nonfinite
    shape = tuple(slots.shape[:-1])
    if tuple(max_norm.shape) not in ((), shape):
        raise ValueError(f"clip stages: max_norm has shape {max_norm.shape}, expected () or {shape}")
    return (f32_aval(shape), jax.core.ShapedArray(shape + (2,), jnp.uint32))


def _apply_abstract_eval(ctrl, *leaves):
    if leaves:
        _batch_shape(leaves, ctrl.ndim - 1)
    return tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)


def _partials_batch(args, dims, *, batch_dims):
    return partials_p.bind(*batching.to_front(args, dims)[1], batch_dims=batch_dims + 1), 0


def _partials_through_batch(args, dims, *, batch_dims):
    out = partials_through_p.bind(*batching.to_front(args, dims)[1], batch_dims=batch_dims + 1)
    return out, (0,) * len(out)


def _finalize_batch(args, dims, *, nonfinite):
    (slots, max_norm), (sd, md) = args, dims
    size = batching.batch_size(args, dims)
    slots = batching.moved_to_front(slots, sd, size)
    if not batching.not_mapped(md) or max_norm.ndim:
        # One max_norm per example: bring it to the slots' example dims.
        max_norm = jnp.broadcast_to(batching.moved_to_front(max_norm, md, size), slots.shape[:-1])
    return finalize_p.bind(slots, max_norm, nonfinite=nonfinite), (0, 0)


def _apply_batch(args, dims):
    ctrl, *leaves = batching.to_front(args, dims)[1]
    return apply_leaves(ctrl, leaves), (0,) * len(leaves)


# Inside shard_map each handed-on or clipped leaf varies where its own leaf does (and, for apply,
# where the decision does), not over the union of all the call's leaves: a replicated leaf clipped
# next to sharded ones stays replicated. (The define_primitive default is the union of all inputs.)


def _partials_through_varying(*leaves):
    return (varying.varying_union(*leaves), *(varying.varying_axes(x) for x in leaves))


def _apply_varying(ctrl, *leaves):
    decision = varying.varying_axes(ctrl)
    return tuple(decision | varying.varying_axes(x) for x in leaves)


def _partials_attributes(batch_dims):
    """The partials calls take no attribute: the handlers count the examples from the slots' leading
    dims (cuda/clip/clip_ffi.h)."""
    del batch_dims
    return {}


partials_p = ffi.define_primitive(
    "jaxdet_clip_partials",
    _partials_abstract_eval,
    attributes=_partials_attributes,
    batching_rule=_partials_batch,
)


# The same target with every leaf also returned, aliased (not written): the stage that reads the
# leaves hands them on, so that the apply stage is the only in-place user of each buffer. (With two
# users, a reader and an in-place writer, XLA's copy insertion copies the leaves first.)
partials_through_p = ffi.define_primitive(
    "jaxdet_clip_partials",
    _partials_through_abstract_eval,
    attributes=_partials_attributes,
    batching_rule=_partials_through_batch,
    multiple_results=True,
    operand_output_aliases=lambda num_operands: {i: i + 1 for i in range(num_operands)},
    result_varying=_partials_through_varying,
)

finalize_p = ffi.define_primitive(
    "jaxdet_clip_finalize",
    _finalize_abstract_eval,
    attributes=_nonfinite_attributes,
    batching_rule=_finalize_batch,
    multiple_results=True,
)

# Operands (ctrl, *leaves); results (*clipped), each aliasing its leaf.
apply_p = ffi.define_primitive(
    "jaxdet_clip_apply",
    _apply_abstract_eval,
    attributes=dict,
    batching_rule=_apply_batch,
    multiple_results=True,
    operand_output_aliases=lambda num_operands: {i: i - 1 for i in range(1, num_operands)},
    result_varying=_apply_varying,
)


# ---- Batching helpers ---------------------------------------------------------------------------


# ---- One-device compositions --------------------------------------------------------------------


def _groups(leaves):
    return [leaves[i : i + MAX_ALIASED_LEAVES] for i in range(0, len(leaves), MAX_ALIASED_LEAVES)]


def partials_through(leaves, *, batch_dims=0):
    """(slots, leaves handed on): the partials stage in groups of at most MAX_ALIASED_LEAVES leaves.

    Chunk slots are numbered leaf by leaf, so the groups' slots side by side are the tree's.
    """
    slots, handed = [], []
    for group in _groups(leaves):
        s, *g = partials_through_p.bind(*group, batch_dims=batch_dims)
        slots.append(s)
        handed.extend(g)
    return (slots[0] if len(slots) == 1 else jnp.concatenate(slots, axis=-1)), handed


def apply_leaves(ctrl, leaves):
    """The apply stage, in groups of at most MAX_ALIASED_LEAVES aliased leaves per call."""
    out = []
    for group in _groups(leaves):
        out.extend(apply_p.bind(ctrl, *group))
    return out


def staged_norm(leaves, *, batch_dims=0):
    slots = partials_p.bind(*leaves, batch_dims=batch_dims)
    norm, _ctrl = finalize_p.bind(slots, jnp.float32(np.inf), nonfinite=0)
    return norm


def staged_clip(leaves, max_norm, nonfinite: int, *, batch_dims=0):
    """(norm, clipped) by the three stages; max_norm is () or the example dims' shape."""
    if not leaves:  # an empty tree has norm 0 (per example: vmap of a batched max_norm)
        return jnp.zeros(jnp.shape(max_norm), jnp.float32), []
    slots, leaves = partials_through(leaves, batch_dims=batch_dims)
    norm, ctrl = finalize_p.bind(slots, max_norm, nonfinite=nonfinite)
    return norm, apply_leaves(ctrl, leaves)


def local_norm(leaves):
    norm, _scratch = global_norm_p.bind(*leaves)
    return norm


def local_clip(leaves, max_norm, nonfinite: int):
    """(norm, clipped) on one device: one fused call, or staged for more than MAX_ALIASED_LEAVES."""
    if len(leaves) <= MAX_ALIASED_LEAVES:
        norm, _scratch, *clipped = clip_p.bind(max_norm, *leaves, nonfinite=nonfinite)
        return norm, clipped
    return staged_clip(leaves, max_norm, nonfinite)
