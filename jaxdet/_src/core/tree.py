"""The canonical summation tree, on one device and across the devices of a mesh axis.

A list of n summands is reduced by the balanced binary tree over the list padded to a power of two
with *absent* leaves, lower index first; a node whose right half is absent equals its left half
(3 summands: ``(x0 + x1) + x2``; 5: ``((x0+x1)+(x2+x3)) + x4``). Every aligned block of 2^j
consecutive summands is a subtree, so a device holding such a block can reduce it alone and hand
the root on: the result does not depend on how many devices the blocks were spread over.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxdet._src.core import varying

# ---- The canonical tree on one device. ----


def _add(x, y):
    return jax.tree.map(lambda u, v: u + v, x, y)


def tree_sum(xs):
    """The canonical tree sum of a non-empty list of arrays (or of pytrees of the same structure).

    Balanced binary tree, lower index first, the list padded to a power of two with absent leaves
    (a node whose right half is absent equals its left half): 3 summands give ``(x0 + x1) + x2``,
    5 give ``((x0 + x1) + (x2 + x3)) + x4``. Adds in the summands' dtype; the reduction of
    device-count-invariant gradients uses float32.
    """
    xs = list(xs)
    if not xs:
        raise ValueError("tree_sum needs at least one summand, got an empty list")
    # Level by level, pairing neighbours and carrying an odd last one up unchanged, is the padded
    # tree: the carried node's sibling is absent.
    while len(xs) > 1:
        xs = [_add(xs[i], xs[i + 1]) if i + 1 < len(xs) else xs[i] for i in range(0, len(xs), 2)]
    return xs[0]


def _tree_rows(p):
    """The canonical tree over the leading axis of one array (any length >= 1)."""
    while p.shape[0] > 1:
        n = p.shape[0]
        pairs = p[0 : n - n % 2 : 2] + p[1 : n - n % 2 : 2]
        p = jnp.concatenate([pairs, p[n - 1 :]], axis=0) if n % 2 else pairs
    return p[0]


# ---- The canonical tree across devices. ----


def axis_names(axis_name, what="axis_name"):
    """`axis_name` (a mesh axis name, or a tuple or list of them) as a tuple, or a TypeError naming `what`."""
    names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a mesh axis name (str) or a non-empty tuple of them, got {axis_name!r}")
    return names


def check_power_of_two(n, what):
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")


def _as_summand(x, names):
    x = jnp.asarray(x)
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"tree_psum sums float (or integer) arrays, got {x.dtype}")
    # Like psum: a value not varying over an axis counts once per device of it.
    return varying.pcast_to_varying(x, names)


_OWN_BUFFER = 1 << 18  # elements (1 MiB of float32)


def _tree_psum_flat(flat, axis, size):
    n = flat.shape[0]
    if n == 0:
        return jnp.zeros((0,), flat.dtype)  # nothing to move (a fresh constant is invariant)
    chunk = -(-n // size)
    if chunk * size != n:
        flat = jnp.pad(flat, (0, chunk * size - n))
    if size > 1:
        # Reduce-scatter by data movement: device k receives chunk k of every device, in device
        # order, and reduces those D pieces by the top levels of the canonical tree.
        pieces = lax.all_to_all(flat.reshape(size, chunk), axis, 0, 0, tiled=True)
        flat = _tree_rows(pieces)
    # All-gather the reduced chunks: the same bits on every device, typed invariant.
    return lax.all_gather(flat, axis, axis=0, tiled=True, to="invarying")[:n]


def tree_psum(x, axis_name):
    """Deterministic all-reduce for ``jax.shard_map`` code: ``psum`` by the canonical tree.

    Args:
      x: a pytree of float arrays, this device's partial sum: the root of the subtree of the
        canonical tree over this device's contiguous block of summands.
      axis_name: a mesh axis name, or a tuple of them. For a tuple the device index is flat with
        the first axis major (as in ``psum``/``all_gather``), so the tree reduces the last
        (minor) axis first. The total size must be a power of two.

    Returns the sum over the axis, by the balanced binary tree over the device index (lower index
    first), with the same bits on every device and typed as invariant over ``axis_name`` (so
    ``out_specs=P()`` is allowed under ``check_vma=True``). A value that is not varying over an
    axis counts once per device, as with ``psum``. Only data moves between devices (all_to_all
    reduce-scatter, then all_gather; the traffic of a ring all-reduce); the adds run locally in
    x's dtype (float32 for device-count-invariant gradients). Any shapes: large leaves travel
    alone and the small leaves of one dtype as one flat buffer, each zero-padded to a multiple of
    the device count (each element's sum is the same tree whatever the packing). An axis of size 1
    is the identity.
    """
    names = axis_names(axis_name)
    size = math.prod(lax.axis_size(n) for n in names)
    check_power_of_two(size, f"the size of mesh axis {axis_name!r}")
    axis = names if len(names) > 1 else names[0]
    leaves, treedef = jax.tree.flatten(x)
    leaves = [_as_summand(leaf, names) for leaf in leaves]
    # One buffer per dtype and per set of other varying axes (which the result keeps); a leaf of
    # at least _OWN_BUFFER elements travels alone: packing it would copy it twice (concatenate,
    # slice) and hold every collective back until the last gradient exists.
    groups = {}
    for i, leaf in enumerate(leaves):
        alone = (i,) if leaf.size >= _OWN_BUFFER else ()
        groups.setdefault((leaf.dtype, varying.varying_axes(leaf) - set(names), alone), []).append(i)
    out = [None] * len(leaves)
    for members in groups.values():
        flats = [leaves[i].reshape(-1) for i in members]
        summed = _tree_psum_flat(jnp.concatenate(flats) if len(flats) > 1 else flats[0], axis, size)
        start = 0
        for i in members:
            out[i] = summed[start : start + leaves[i].size].reshape(leaves[i].shape)
            start += leaves[i].size
    return jax.tree.unflatten(treedef, out)


def tree_psum_untyped(x, axes: tuple):
    """`tree_psum` for a custom_partitioning lowering, whose per-device values
    carry no shard_map types: the same canonical tree over the device index (lower index first),
    with data movement only (all_to_all as a reduce-scatter, then all_gather)."""
    size = math.prod(lax.axis_size(n) for n in axes)
    if size == 1:
        return x
    axis = axes if len(axes) > 1 else axes[0]
    flat = x.reshape(-1)
    n = flat.shape[0]
    chunk = -(-n // size)
    flat = jnp.pad(flat, (0, chunk * size - n))
    pieces = lax.all_to_all(flat.reshape(size, chunk), axis, 0, 0, tiled=True)
    part = tree_sum([pieces[i] for i in range(size)])
    return lax.all_gather(part, axis, axis=0, tiled=True)[:n].reshape(x.shape)


def match_varying(ct, vma: frozenset):
    """A cotangent typed as its primal (varying over exactly `vma`).

    Axes the cotangent varies over but the primal does not are summed by `tree_psum` (the
    canonical tree, device-count invariant where the summands line up; never ``psum``), so compute
    such a cotangent in float32 and cast it after this. Axes the primal varies over but the
    cotangent does not are a type change only (``pcast``).
    """
    have = varying.varying_axes(ct)
    extra, missing = have - vma, vma - have
    if extra:
        ct = tree_psum(ct, varying.mesh_order(extra))
    if missing:
        ct = lax.pcast(ct, varying.mesh_order(missing), to="varying")
    return ct


def whole_chunk_split(factor: str, chunk: int):
    """A `Partitioning.can_split` rule for a reduction by the canonical chunk tree over `factor`:
    split it over devices only where every device holds 2^j whole chunks of `chunk` elements (its
    chunk tree is then a subtree of the unsplit one, so the devices' roots, combined by the top
    levels, give exactly the unsplit bits); other splits would change the bits, so that factor is
    all-gathered instead. Other factors split freely."""

    def can_split(name, size, parts):
        if name != factor:
            return True
        chunks, rest = divmod(size // parts, chunk)
        return rest == 0 and chunks > 0 and chunks & (chunks - 1) == 0

    return can_split


def cotangent(compute, dtype, vma: frozenset, others):
    """A cotangent of `dtype` typed as its primal (varying over exactly `vma`): `compute(out_dtype)`
    computes it. Under shard_map, axes it varies over but the primal does not (a replicated weight
    or table next to sharded tokens) are summed by the canonical tree in float32, then cast once."""
    if varying.varying_union(*others) - vma:
        return match_varying(compute(jnp.float32), vma).astype(dtype)
    return match_varying(compute(dtype), vma)


def reduce_over_devices(compute, axes: tuple, out_dtype):
    """A composite's local rule for a reduction by the canonical chunk tree whose reduced dimension
    may be split over the mesh `axes`: `compute(dtype)` reduces this device's whole chunks; with
    the dimension split, the devices' float32 subtree roots meet in the tree's top levels."""
    if not axes:
        return compute(out_dtype)
    return tree_psum_untyped(compute(jnp.float32), axes).astype(out_dtype)
