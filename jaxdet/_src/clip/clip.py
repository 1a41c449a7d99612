"""Fused, deterministic global-norm gradient clipping.

The contract (docs/clipping.md, proven by tests/test_clip.py and tests/test_clip_sharding.py): the
whole norm -> scale -> clip pipeline runs inside the compiled step (no host sync, no device-to-host
copy), as one native call for up to 256 leaves or as three staged calls (jaxdet/_clip_kernels.py).
The norm is reduced in one canonical order (4096-element chunks, a fixed 256-lane tree inside a
chunk, a fixed float64 1024-lane tree over the chunks; cuda/clip/clip_math.h), so the norm and every
clipped element are bitwise identical on CPU and GPU, from run to run, per example under vmap, and
for a tree sharded over devices (jaxdet/_clip_parallel.py).

    norm  = sqrt(sum of squares), accumulated in float32 per chunk (also for bfloat16 / float16
            leaves) and in float64 over chunks, rounded once to float32
    scale = 1                  if norm <= max_norm (so norm == 0 never divides) or max_norm == inf
          = max_norm / norm    otherwise (one float32 division)
    leaf  = leaf (same bits)   if scale == 1
          = dtype(float32(leaf) * scale) otherwise (NaN results are the canonical quiet NaN)

Non-finite norms follow ``nonfinite``: ``"propagate"`` (default, as optax: an inf norm gives scale 0,
a NaN norm a NaN scale) or ``"skip"`` (every leaf becomes +0, as ``optax.apply_if_finite`` skips).
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.clip import primitives, sharding
from jaxdet._src.core import tree
from jaxdet._src.core.checks import (
    FLOAT_DTYPES,
    is_traced,  # noqa: F401 (re-exported for jaxdet.optax)
)

__all__ = ["clip_by_global_norm", "global_norm", "CHUNK_SIZE", "NONFINITE_POLICIES"]

CHUNK_SIZE = primitives.CHUNK_SIZE  # elements per chunk (cuda/clip/clip_math.h kChunk)
SUPPORTED_DTYPES = FLOAT_DTYPES
NONFINITE_POLICIES = {"propagate": 0, "skip": 1}  # cuda/clip/clip_math.h Policy
_LEAF_FORM = "a float32, bfloat16 or float16 array"


# ---- Argument checks --------------------------------------------------------------------------


def _check_leaves(tree, fn: str):
    """The leaves as arrays, with their paths; errors name the leaf and the expected form."""
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves, paths = [], []
    for path, leaf in path_leaves:
        where = jax.tree_util.keystr(path) or "<root>"
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"{fn}: leaf {where} is a jax.ShapeDtypeStruct (a shape, not an array); it must be {_LEAF_FORM} "
                "(for shapes only, trace the call with jax.eval_shape)"
            )
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not hasattr(leaf, "shape"):
            raise TypeError(f"{fn}: leaf {where} must be {_LEAF_FORM}, got {type(leaf).__name__}")
        if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
            raise TypeError(
                f"{fn}: leaf {where} has dtype {dtype} (e.g. a typed jax.random key), not a float; it must be "
                f"{_LEAF_FORM}: leave keys and other non-gradient state out of the tree"
            )
        if np.dtype(dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{fn}: leaf {where} has dtype {np.dtype(dtype).name}; only float32, bfloat16 and float16 "
                "leaves are supported (cast integer or float64 leaves first, or leave them out of the tree)"
            )
        leaves.append(leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf))
        paths.append(where)
    return leaves, paths, treedef


def _check_max_norm(max_norm):
    if isinstance(max_norm, (bool, np.bool_)):
        raise TypeError("clip_by_global_norm: max_norm must be a real number, got a bool")
    dtype = getattr(max_norm, "dtype", None)
    if dtype is None and not isinstance(max_norm, numbers.Real):
        raise TypeError(f"clip_by_global_norm: max_norm must be a real scalar, got {type(max_norm).__name__}")
    if dtype is not None and not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"clip_by_global_norm: max_norm must be a real scalar, got dtype {dtype}")
    shape = tuple(getattr(max_norm, "shape", ()))
    if shape != ():
        raise ValueError(f"clip_by_global_norm: max_norm must be a scalar, got shape {shape}")
    on_device = isinstance(max_norm, jax.Array)
    if is_traced(max_norm) or (on_device and not max_norm.is_fully_addressable):
        # A traced value cannot be checked before the kernel runs (that would be a host sync); the
        # kernel's rule covers it instead: negative acts as 0, NaN gives NaN (docs/clipping.md).
        return jnp.asarray(max_norm, jnp.float32)
    # A concrete value is checked here, a jax.Array too: it is one scalar, and only eager calls see
    # one (under jit it is traced).
    value = float(np.asarray(max_norm))
    if math.isnan(value) or value < 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be >= 0 (or inf), got {value}")
    return jnp.asarray(max_norm, jnp.float32) if on_device else np.float32(value)


def _check_policy(nonfinite) -> int:
    if not isinstance(nonfinite, str):
        raise TypeError(f"nonfinite must be one of {sorted(NONFINITE_POLICIES)}, got {type(nonfinite).__name__}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {sorted(NONFINITE_POLICIES)}, got {nonfinite!r}")
    return NONFINITE_POLICIES[nonfinite]


def _check_axis_name(axis_name):
    return None if axis_name is None else tree.axis_names(axis_name)


def _any_varying(values) -> bool:
    return any(sharding.varying_axes(x) for x in values)


# ---- Public API -------------------------------------------------------------------------------


def global_norm(tree, *, axis_name=None) -> jax.Array:
    """The global L2 norm of a pytree of float32 / bfloat16 / float16 arrays, as a float32 scalar.

    Same canonical order, and so the same bits, as the norm ``clip_by_global_norm`` returns, on any
    backend. An empty tree (or one of empty leaves) has norm 0. ``axis_name`` (inside
    ``jax.shard_map``): the norm of the tree whose leaves are sharded over that mesh axis (or tuple
    of axes), bitwise the unsharded norm; see ``clip_by_global_norm``.
    """
    leaves, paths, _ = _check_leaves(tree, "global_norm")
    names = _check_axis_name(axis_name)
    if names is not None and leaves:
        return sharding.shard_map_norm(leaves, paths, names)
    if not leaves or _any_varying(leaves):
        return primitives.local_norm(leaves)
    (norm,) = sharding.norm_tree_p.bind(*leaves)
    return norm


def clip_by_global_norm(tree, max_norm, *, nonfinite: str = "propagate", axis_name=None):
    """Scale every leaf by ``min(1, max_norm / global_norm(tree))``; return ``(clipped_tree, norm)``.

    Args:
      tree: any pytree of float32 / bfloat16 / float16 arrays (0-d and empty leaves included).
      max_norm: a scalar >= 0 (``inf`` never clips); may be traced.
      nonfinite: ``"propagate"`` (default; like optax: an inf norm zeroes finite entries and makes
        inf entries NaN, a NaN norm makes every entry NaN; with ``max_norm=inf`` nothing changes) or
        ``"skip"`` (a non-finite norm turns every leaf into +0, i.e. the step is skipped).
      axis_name: inside ``jax.shard_map`` (``check_vma=True``), a mesh axis name or tuple of them:
        the leaves are the local shards of a tree sharded over those axes, and the norm is the
        global one, bitwise the unsharded call's. A leaf that varies over the axes is the local
        block of a leaf split along its leading dimension in device order (first axis major); a
        leaf invariant over them is replicated and counted once. Blocks of whole 4096-element
        chunks need no data movement but an all-gather of one float per chunk; other sharded
        leaves are all-gathered first (same bits). ``max_norm`` must be invariant over the axes.

    Returns:
      ``(clipped_tree, norm)``: ``norm`` is the float32 pre-clip global norm (for logging; it is
      inf/NaN exactly when a step was skipped under ``"skip"``). When the scale is 1 every clipped
      leaf has its input's exact bits. Every clipped leaf aliases its input, so inside a jitted
      step clipping needs no extra gradient-sized buffers. Under ``jax.vmap`` each example is
      clipped by its own norm (per-example clipping), bitwise as if called alone.
    """
    policy = _check_policy(nonfinite)
    leaves, paths, treedef = _check_leaves(tree, "clip_by_global_norm")
    max_norm = _check_max_norm(max_norm)
    names = _check_axis_name(axis_name)
    if names is not None and leaves:
        norm, clipped = sharding.shard_map_clip(leaves, paths, max_norm, policy, names)
    elif not leaves or _any_varying([max_norm, *leaves]):
        norm, clipped = primitives.local_clip(leaves, max_norm, policy)
    else:
        norm, *clipped = sharding.clip_tree_p.bind(max_norm, *leaves, nonfinite=policy)
    return jax.tree_util.tree_unflatten(treedef, clipped), norm


# The public functions carry their constants (jaxdet.clip_by_global_norm.NONFINITE_POLICIES, ...).
clip_by_global_norm.NONFINITE_POLICIES = NONFINITE_POLICIES
clip_by_global_norm.CHUNK_SIZE = global_norm.CHUNK_SIZE = CHUNK_SIZE
