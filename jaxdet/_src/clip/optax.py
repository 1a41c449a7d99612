"""optax drop-in: ``jaxdet.optax.clip_by_global_norm(max_norm)``.

A ``GradientTransformation`` that replaces ``optax.clip_by_global_norm`` with jaxdet's fused,
deterministic clip (one native call, bitwise equal on CPU and GPU; docs/clipping.md). Its state
carries the last pre-clip global norm, so a training loop can log it without a second pass over the
gradients (optax#326): ``state.norm`` (or ``jaxdet.optax.last_norm(opt_state)`` inside a chain).

optax is imported lazily: importing ``jaxdet`` never needs it, building the transformation does.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxdet._src.clip import clip

__all__ = ["clip_by_global_norm", "ClipByGlobalNormState", "last_norm"]


def _require_optax():
    try:
        import optax  # noqa: PLC0415 (lazy on purpose)
    except ImportError as e:  # pragma: no cover - exercised only without optax
        raise ImportError(
            "jaxdet.optax needs optax, which is not installed: `pip install optax` "
            "(or install jaxdet with its test extra, `pip install jaxdet[test]`)."
        ) from e
    return optax


class ClipByGlobalNormState(NamedTuple):
    """``norm``: the pre-clip global norm of the last update (float32; 0 before the first update).
    ``num_nonfinite``: how many updates had a non-finite norm (those were zeroed under "skip")."""

    norm: jax.Array
    num_nonfinite: jax.Array


def clip_by_global_norm(max_norm, *, nonfinite: str = "propagate", axis_name=None):
    """Drop-in for ``optax.clip_by_global_norm(max_norm)``; see ``jaxdet.clip_by_global_norm``.

    Same updates as optax's to rounding (optax scales by ``(g / norm) * max_norm`` in the leaf dtype,
    jaxdet by ``float32(g) * float32(max_norm / norm)``; the norm is accumulated in float32, where
    optax's overflows for float16 leaves). Differences on purpose: ``norm == max_norm`` is not
    clipped, ``max_norm == 0`` with zero gradients gives zeros (optax: NaN), ``nonfinite="skip"``
    zeroes the update when the norm is inf or NaN, and float64 leaves are rejected (a TypeError
    naming the leaf). ``axis_name``: inside ``jax.shard_map``, the updates are shards of a tree
    sharded over that mesh axis (or axes), clipped by their global norm (see
    ``jaxdet.clip_by_global_norm``). As optax allows for a transform without state, ``update``
    also accepts ``state=None``; the state it returns then counts from that update.
    """
    optax = _require_optax()
    clip._check_policy(nonfinite)  # errors at construction, before anything runs
    clip._check_axis_name(axis_name)
    if not clip.is_traced(max_norm):
        clip._check_max_norm(max_norm)

    def init_fn(params):
        del params
        return ClipByGlobalNormState(norm=jnp.zeros((), jnp.float32), num_nonfinite=jnp.zeros((), jnp.int32))

    def update_fn(updates, state, params=None):
        del params
        clipped, norm = clip.clip_by_global_norm(updates, max_norm, nonfinite=nonfinite, axis_name=axis_name)
        skipped = jnp.logical_not(jnp.isfinite(norm)).astype(jnp.int32)
        num = skipped if state is None else state.num_nonfinite + skipped
        return clipped, ClipByGlobalNormState(norm=norm, num_nonfinite=num)

    return optax.GradientTransformation(init_fn, update_fn)


def last_norm(opt_state):
    """The ``norm`` of the first ``ClipByGlobalNormState`` found in a (chained) optax state."""
    for node in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda n: isinstance(n, ClipByGlobalNormState)):
        if isinstance(node, ClipByGlobalNormState):
            return node.norm
    raise ValueError("no jaxdet.optax.clip_by_global_norm state in this optimizer state")
