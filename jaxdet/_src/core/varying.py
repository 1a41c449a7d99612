"""Varying manual axes: the mesh axes a value varies over inside ``jax.shard_map`` (check_vma)."""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec


def varying_axes(x) -> frozenset:
    """The mesh axes a value (or an abstract value) varies over inside ``jax.shard_map``."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def mesh_order(axes) -> tuple:
    """`axes` in the order of the current mesh's axis names (the order the canonical tree uses)."""
    names = jax.sharding.get_abstract_mesh().axis_names
    return tuple(n for n in names if n in axes) + tuple(sorted(n for n in axes if n not in names))


def with_varying(aval, vma: frozenset):
    """`aval` typed as varying over `vma` (in the current shard_map's abstract mesh)."""
    if not vma or not isinstance(aval, jax.core.ShapedArray) or varying_axes(aval) == vma:
        return aval
    sharding = aval.sharding
    if sharding.mesh.empty:
        sharding = NamedSharding(jax.sharding.get_abstract_mesh(), PartitionSpec())
    return aval.update(sharding=sharding, manual_axis_type=aval.mat.update(varying=vma))


def varying_union(*xs) -> frozenset:
    return frozenset().union(*(varying_axes(x) for x in xs))


def pcast_to_varying(x, names):
    """`x` typed as varying over every axis of `names` (those it does not vary over yet are cast)."""
    missing = tuple(n for n in names if n not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x
