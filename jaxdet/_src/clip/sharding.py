"""Clipping a tree whose leaves are sharded over devices, with the unsharded call's bits.

The canonical order (docs/clipping.md) only needs the chunk partials of every chunk, in the global
slot order. When each device holds whole chunks of a leaf, its chunk partials are exactly the
global ones, so the norm is bitwise the unsharded norm if every device

1. computes the partials of its own shards (``jaxdet_clip_partials``, no data moves),
2. all-gathers the partial slots (data movement only: one float per 4096 elements) and permutes
   them into the global slot order (a gather with constant indices),
3. runs the float64 finalize tree over the global slots (identically on every device),
4. scales its own shards by the resulting decision (``jaxdet_clip_apply``, aliased).

Alignment: a sharded leaf is split along its leading dimension into equal contiguous blocks, in
device order (mesh axes major first), and each block holds a whole number of 4096-element chunks.
A leaf replicated over the devices is counted once. A sharded leaf that is not aligned is first
all-gathered along its leading dimension (more traffic, same bits). Both ``jax.shard_map``
(``axis_name=``) and sharded ``jax.jit`` (``custom_partitioning``) use this plan.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxdet._src.clip import primitives
from jaxdet._src.core import batching, ffi
from jaxdet._src.core.tree import axis_names
from jaxdet._src.core.varying import varying_axes

# ---- The plan: which device holds which chunk -----------------------------------------------------


def is_aligned(local_shape, blocks: int) -> bool:
    """A leaf cut into `blocks` leading-dim blocks of `local_shape` keeps whole chunks per block."""
    return blocks == 1 or (len(local_shape) >= 1 and math.prod(local_shape) % primitives.CHUNK_SIZE == 0)


def slot_permutation(local_shapes, leaf_axes, gather_axes, axis_sizes) -> np.ndarray:
    """Indices into the all-gathered slots (device-major, in `gather_axes` order) of the global slots.

    Leaf i's local chunks are local slots [o_i, o_i + c_i) on every device; its global chunks are
    those of its blocks in order, block k living on the device whose coordinates along
    `leaf_axes[i]` are k (row-major, first axis major) and 0 along the other gather axes. A leaf
    with no axes is replicated: device 0's copy counts, once.
    """
    strides, s = {}, 1
    for a in reversed(gather_axes):
        strides[a] = s
        s *= axis_sizes[a]
    counts = [primitives.chunks_of(math.prod(shape)) for shape in local_shapes]
    local_total = sum(counts)
    parts, offset = [], 0
    for c, axes in zip(counts, leaf_axes):
        devices = np.zeros((1,), np.int64)
        for a in axes:
            devices = (devices[:, None] + np.arange(axis_sizes[a])[None, :] * strides[a]).reshape(-1)
        parts.append((devices[:, None] * local_total + offset + np.arange(c)[None, :]).reshape(-1))
        offset += c
    perm = np.concatenate(parts) if parts else np.zeros((0,), np.int64)
    return perm.astype(np.int32 if perm.size == 0 or perm.max() < 2**31 else np.int64)


def global_slots(leaves, leaf_axes, axis_order, axis_sizes, *, invariant: bool, hand_on: bool = False):
    """Steps 1-2: the global chunk slots, on every device, from each device's own leaves.

    Returns (slots, leaves): with `hand_on`, the leaves come back handed on by the partials calls,
    for the apply stage to be their only in-place user (jaxdet/_clip_kernels.py).
    """
    if hand_on:
        slots, leaves = primitives.partials_through(list(leaves))
    else:
        slots = primitives.partials_p.bind(*leaves, batch_dims=0)
    gather_axes = tuple(a for a in axis_order if any(a in axes for axes in leaf_axes))
    if gather_axes:
        extra = {"to": "invarying"} if invariant else {}
        gathered = lax.all_gather(slots, gather_axes, axis=0, tiled=True, **extra)
        perm = slot_permutation([x.shape for x in leaves], leaf_axes, gather_axes, axis_sizes)
        slots = gathered.at[perm].get(mode="promise_in_bounds", unique_indices=True)
    return slots, list(leaves)


# ---- shard_map: axis_name= ----------------------------------------------------------------------


def _shard_map_plan(leaves, paths, names, fn):
    sizes = {a: lax.axis_size(a) for a in names}
    part_leaves, leaf_axes = [], []
    for leaf, path in zip(leaves, paths):
        varying = varying_axes(leaf)
        axes = tuple(a for a in names if a in varying)
        if axes and leaf.ndim == 0:
            raise ValueError(
                f"{fn}: leaf {path} is a 0-d array that varies over {axes}; with axis_name a varying leaf "
                "must be a shard of a leaf sharded along its leading dimension (or replicated)"
            )
        if axes and not is_aligned(leaf.shape, math.prod(sizes[a] for a in axes)):
            # Shards that do not hold whole chunks: gather the leaf (its data, once) so its chunks
            # are the unsharded ones; the bits do not change, the traffic does.
            leaf = lax.all_gather(leaf, axes if len(axes) > 1 else axes[0], axis=0, tiled=True, to="invarying")
            axes = ()
        part_leaves.append(leaf)
        leaf_axes.append(axes)
    return part_leaves, leaf_axes, sizes


def shard_map_norm(leaves, paths, axis_name):
    names = axis_names(axis_name)
    part_leaves, leaf_axes, sizes = _shard_map_plan(leaves, paths, names, "global_norm")
    slots, _ = global_slots(part_leaves, leaf_axes, names, sizes, invariant=True)
    norm, _ctrl = primitives.finalize_p.bind(slots, jnp.float32(np.inf), nonfinite=0)
    return norm


def shard_map_clip(leaves, paths, max_norm, nonfinite: int, axis_name):
    names = axis_names(axis_name)
    bad = varying_axes(max_norm) & set(names)
    if bad:
        raise ValueError(
            f"clip_by_global_norm: max_norm varies over {sorted(bad)}; with axis_name it must be the same "
            "on every device (invariant over axis_name)"
        )
    part_leaves, leaf_axes, sizes = _shard_map_plan(leaves, paths, names, "clip_by_global_norm")
    slots, handed = global_slots(part_leaves, leaf_axes, names, sizes, invariant=True, hand_on=True)
    # A gathered (misaligned) leaf was handed on in its gathered form: clip the local one.
    local = [h if p is x else x for h, p, x in zip(handed, part_leaves, leaves)]
    norm, ctrl = primitives.finalize_p.bind(slots, max_norm, nonfinite=nonfinite)
    return norm, primitives.apply_leaves(ctrl, local)


# ---- Sharded jit: custom_partitioning -----------------------------------------------------------


def _leaf_axes_of(shape, sharding, mesh):
    """The mesh axes an aligned leaf's leading dim is sharded over, or None to replicate it."""
    if not isinstance(sharding, NamedSharding) or sharding.mesh.shape != mesh.shape:
        return None
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    if not shape:
        return ()
    if any(entry is not None for entry in spec[1:]):
        return None
    first = spec[0]
    axes = () if first is None else (first,) if isinstance(first, str) else tuple(first)
    blocks = math.prod(mesh.shape[a] for a in axes)
    if shape[0] % blocks:
        return None
    local = (shape[0] // blocks,) + tuple(shape[1:])
    return axes if is_aligned(local, blocks) else None


def _leaf_plan(mesh, leaf_shapes):
    axes, shardings = [], []
    for arg in leaf_shapes:
        a = _leaf_axes_of(tuple(arg.shape), arg.sharding, mesh)
        if a is None:
            a = ()
        axes.append(a)
        spec = PartitionSpec() if not a else PartitionSpec(a if len(a) > 1 else a[0])
        shardings.append(NamedSharding(mesh, spec))
    return axes, shardings


def _replicated(mesh):
    return NamedSharding(mesh, PartitionSpec())


def _sharded_norm(leaves, leaf_axes, mesh):
    slots, _ = global_slots(leaves, leaf_axes, mesh.axis_names, dict(mesh.shape), invariant=False)
    norm, _ctrl = primitives.finalize_p.bind(slots, jnp.float32(np.inf), nonfinite=0)
    return norm


def _norm_partition(mesh, arg_shapes, result_shape):
    del result_shape
    leaf_axes, arg_shardings = _leaf_plan(mesh, arg_shapes)

    def lower_fn(*leaves):
        return _sharded_norm(leaves, leaf_axes, mesh)

    return mesh, lower_fn, _replicated(mesh), tuple(arg_shardings)


def _clip_partition(nonfinite, mesh, arg_shapes, result_shape):
    del result_shape
    leaf_axes, leaf_shardings = _leaf_plan(mesh, arg_shapes[1:])

    def lower_fn(max_norm, *leaves):
        slots, leaves = global_slots(
            leaves, leaf_axes, mesh.axis_names, dict(mesh.shape), invariant=False, hand_on=True
        )
        norm, ctrl = primitives.finalize_p.bind(slots, max_norm, nonfinite=nonfinite)
        return (norm, *primitives.apply_leaves(ctrl, leaves))

    arg_shardings = (_replicated(mesh), *leaf_shardings)
    return mesh, lower_fn, (_replicated(mesh), *leaf_shardings), arg_shardings


def _factors(i, ndim):
    return tuple(f"l{i}d{d}" for d in range(ndim))


def _norm_rule(mesh, value_types, result_types):
    del mesh, result_types
    return SdyShardingRule(
        operand_mappings=tuple(_factors(i, len(t.shape)) for i, t in enumerate(value_types)),
        result_mappings=((),),
    )


def _clip_rule(nonfinite, mesh, value_types, result_types):
    del nonfinite, mesh, result_types
    leaves = tuple(_factors(i, len(t.shape)) for i, t in enumerate(value_types[1:]))
    return SdyShardingRule(operand_mappings=((),) + leaves, result_mappings=((),) + leaves)


def _norm_infer(mesh, arg_shapes, result_shape):
    del arg_shapes, result_shape
    return _replicated(mesh)


def _clip_infer(nonfinite, mesh, arg_shapes, result_shape):
    del nonfinite, result_shape
    return (_replicated(mesh), *_leaf_plan(mesh, arg_shapes[1:])[1])


def _norm_body(*leaves):
    return primitives.local_norm(list(leaves))


def _clip_body(nonfinite, max_norm, *leaves):
    norm, clipped = primitives.local_clip(list(leaves), max_norm, nonfinite)
    return (norm, *clipped)


_partitioned_norm = custom_partitioning(_norm_body)
_partitioned_norm.def_partition(_norm_partition, infer_sharding_from_operands=_norm_infer, sharding_rule=_norm_rule)
_partitioned_clip = custom_partitioning(_clip_body, static_argnums=(0,))
_partitioned_clip.def_partition(_clip_partition, infer_sharding_from_operands=_clip_infer, sharding_rule=_clip_rule)


# The public functions bind these: on one device (or fully inside shard_map) they lower to the
# one-device body; under a sharded jit XLA's partitioner calls the plan above. They are
# primitives (not bare custom_partitioning calls) so that vmap, which has no rule for
# custom_partitioning, gets theirs: the staged kernels with one decision per example.


def _norm_tree_batch(args, dims):
    return [primitives.staged_norm(batching.to_front(args, dims)[1], batch_dims=1)], [0]


def _clip_tree_batch(args, dims, *, nonfinite):
    max_norm, *leaves = batching.to_front(args, dims)[1]
    norm, clipped = primitives.staged_clip(leaves, max_norm, nonfinite, batch_dims=1)
    return [norm, *clipped], [0] * (len(clipped) + 1)


norm_tree_p = ffi.define_lowered(
    "jaxdet_global_norm_tree",
    lambda *leaves: [primitives.f32_aval()],
    lambda *leaves: [_partitioned_norm(*leaves)],
    _norm_tree_batch,
    multiple_results=True,
)
clip_tree_p = ffi.define_lowered(
    "jaxdet_clip_tree",
    lambda max_norm, *leaves, nonfinite: [
        primitives.f32_aval(),
        *(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves),
    ],
    lambda max_norm, *leaves, nonfinite: list(_partitioned_clip(nonfinite, max_norm, *leaves)),
    _clip_tree_batch,
    multiple_results=True,
)
