"""Fused, deterministic global-norm gradient clipping.

The contract (docs/clipping.md, proven by tests/test_clip.py): the whole norm -> scale -> clip
pipeline is one native call over all leaves of the tree, inside the compiled step (no host sync, no
device-to-host copy). The norm is reduced in one canonical order (4096-element chunks, a fixed
256-lane tree inside a chunk, a fixed float64 1024-lane tree over the chunks; cuda/clip_math.h), so
the norm and every clipped element are bitwise identical on CPU and GPU and from run to run.

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

from jaxdet import _ffi
from jaxdet._checks import is_traced  # noqa: F401 (re-exported for jaxdet.optax)

__all__ = ["clip_by_global_norm", "global_norm", "CHUNK_SIZE", "NONFINITE_POLICIES"]

CHUNK_SIZE = 4096  # elements per chunk (cuda/clip_math.h kChunk)
SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
NONFINITE_POLICIES = {"propagate": 0, "skip": 1}  # cuda/clip_math.h Policy


def num_chunks(shapes) -> int:
    """Number of chunk slots: chunks never span leaves, empty leaves have none."""
    return sum(-(-math.prod(s) // CHUNK_SIZE) for s in shapes)


def _scratch_aval(leaves):
    # Chunk slots, then the clip decision (scale, mode): device memory the kernels hand on.
    return jax.core.ShapedArray((num_chunks([x.shape for x in leaves]) + 2,), jnp.float32)


# ---- Primitives -------------------------------------------------------------------------------

def _global_norm_abstract_eval(*leaves):
    return (jax.core.ShapedArray((), jnp.float32), _scratch_aval(leaves))


global_norm_p = _ffi.define_primitive(
    "jaxdet_global_norm", _global_norm_abstract_eval, attributes=lambda: {}, multiple_results=True
)


def _clip_abstract_eval(max_norm, *leaves, nonfinite):
    del max_norm, nonfinite
    return (
        jax.core.ShapedArray((), jnp.float32),
        _scratch_aval(leaves),
        *(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves),
    )


# Operands (max_norm, *leaves); results (norm, scratch, *clipped). Every clipped leaf aliases its
# input buffer, so clipping allocates no gradient-sized buffer (XLA copies only an operand that is
# still live afterwards, e.g. a non-donated jit argument).
clip_p = _ffi.define_primitive(
    "jaxdet_clip_global_norm",
    _clip_abstract_eval,
    attributes=lambda nonfinite: dict(nonfinite=np.int32(nonfinite)),
    multiple_results=True,
    operand_output_aliases=lambda num_operands: {i: i + 1 for i in range(1, num_operands)},
)


# ---- Argument checks --------------------------------------------------------------------------

def _check_leaves(tree, fn: str):
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = []
    for path, leaf in path_leaves:
        where = jax.tree_util.keystr(path) or "<root>"
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not hasattr(leaf, "shape"):
            raise TypeError(
                f"{fn}: leaf {where} must be a float32, bfloat16 or float16 array, got {type(leaf).__name__}"
            )
        if np.dtype(dtype) not in SUPPORTED_DTYPES:
            raise TypeError(
                f"{fn}: leaf {where} has dtype {np.dtype(dtype).name}; only float32, bfloat16 and float16 "
                "leaves are supported (cast integer or float64 leaves first, or leave them out of the tree)"
            )
        leaves.append(leaf if isinstance(leaf, jax.Array) else jnp.asarray(leaf))
    return leaves, treedef


def _check_max_norm(max_norm):
    if isinstance(max_norm, (bool, np.bool_)):
        raise TypeError("clip_by_global_norm: max_norm must be a real number, got a bool")
    dtype = getattr(max_norm, "dtype", None)
    if dtype is None and not isinstance(max_norm, numbers.Real):
        raise TypeError(f"clip_by_global_norm: max_norm must be a real scalar, got {type(max_norm).__name__}")
    if dtype is not None and not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"clip_by_global_norm: max_norm must be a real scalar, got dtype {np.dtype(dtype).name}")
    shape = tuple(getattr(max_norm, "shape", ()))
    if shape != ():
        raise ValueError(f"clip_by_global_norm: max_norm must be a scalar, got shape {shape}")
    if is_traced(max_norm) or isinstance(max_norm, jax.Array):
        # Traced values and device arrays are not read back (that would be a host sync); the
        # kernel's rule covers them instead: a negative max_norm acts as 0 (docs/clipping.md).
        return jnp.asarray(max_norm, jnp.float32)
    value = float(np.asarray(max_norm))
    if math.isnan(value) or value < 0:
        raise ValueError(f"clip_by_global_norm: max_norm must be >= 0 (or inf), got {value}")
    return np.float32(value)


def _check_policy(nonfinite) -> int:
    if not isinstance(nonfinite, str):
        raise TypeError(f"nonfinite must be one of {sorted(NONFINITE_POLICIES)}, got {type(nonfinite).__name__}")
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {sorted(NONFINITE_POLICIES)}, got {nonfinite!r}")
    return NONFINITE_POLICIES[nonfinite]


# ---- Public API -------------------------------------------------------------------------------

def global_norm(tree) -> jax.Array:
    """The global L2 norm of a pytree of float32 / bfloat16 / float16 arrays, as a float32 scalar.

    Same canonical order, and so the same bits, as the norm ``clip_by_global_norm`` returns, on any
    backend. An empty tree (or one of empty leaves) has norm 0.
    """
    leaves, _ = _check_leaves(tree, "global_norm")
    norm, _scratch = global_norm_p.bind(*leaves)
    return norm


def clip_by_global_norm(tree, max_norm, *, nonfinite: str = "propagate"):
    """Scale every leaf by ``min(1, max_norm / global_norm(tree))``; return ``(clipped_tree, norm)``.

    Args:
      tree: any pytree of float32 / bfloat16 / float16 arrays (0-d and empty leaves included).
      max_norm: a scalar >= 0 (``inf`` never clips); may be traced.
      nonfinite: ``"propagate"`` (default; like optax: an inf norm zeroes finite entries and makes
        inf entries NaN, a NaN norm makes every entry NaN; with ``max_norm=inf`` nothing changes) or
        ``"skip"`` (a non-finite norm turns every leaf into +0, i.e. the step is skipped).

    Returns:
      ``(clipped_tree, norm)``: ``norm`` is the float32 pre-clip global norm (for logging; it is
      inf/NaN exactly when a step was skipped under ``"skip"``). When the scale is 1 every clipped
      leaf has its input's exact bits. One native call covers all leaves; its outputs alias its
      inputs, so inside a jitted step clipping needs no extra gradient-sized buffers.
    """
    policy = _check_policy(nonfinite)
    leaves, treedef = _check_leaves(tree, "clip_by_global_norm")
    max_norm = _check_max_norm(max_norm)
    norm, _scratch, *clipped = clip_p.bind(max_norm, *leaves, nonfinite=policy)
    return jax.tree_util.tree_unflatten(treedef, clipped), norm
