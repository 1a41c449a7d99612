"""Device-count-invariant data parallelism: one canonical summation tree, lined up with devices.

The contracts (docs/parallel.md, proven by tests/test_parallel.py and tests/test_multiprocess.py):

* The canonical tree. A list of n summands is reduced by the balanced binary tree over the list
  padded to a power of two with *absent* leaves, lower index first; a node whose right half is
  absent equals its left half (3 summands: ``(x0 + x1) + x2``; 5: ``((x0+x1)+(x2+x3)) + x4``).
  Every aligned block of 2^j consecutive summands is a subtree, so a device holding such a block
  can reduce it alone and hand the root on: the result does not depend on how many devices the
  blocks were spread over.
* ``tree_psum(x, axis_name)``: the sum over a mesh axis by that tree over the device index, with
  data-movement collectives only (all_to_all as a reduce-scatter, all_gather), so every device
  gets the same bits and no collective library chooses an order.
* ``value_and_grad(loss_fn, mesh=..., axis_name=..., leaves=L)``: the loss and gradients over a
  global batch of L leaves, each leaf's computed as if alone, combined by the tree; the bits are
  the same for 1, 2, 4, ... devices (any power of two up to L).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["tree_sum", "tree_psum"]


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

def _axis_names(axis_name, what="axis_name"):
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{what} must be a mesh axis name (str) or a non-empty tuple of them, got {axis_name!r}")
    return names


def _varying_axes(x):
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _check_power_of_two(n, what):
    if n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")


def _tree_psum_leaf(x, names, size):
    x = jnp.asarray(x)
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"tree_psum sums float (or integer) arrays, got {x.dtype}")
    # Like psum: a value not varying over an axis counts once per device of it.
    missing = tuple(n for n in names if n not in _varying_axes(x))
    if missing:
        x = lax.pcast(x, missing, to="varying")
    axis = names if len(names) > 1 else names[0]
    flat = x.reshape(-1)
    n = flat.shape[0]
    chunk = -(-n // size) if n else 0
    if chunk * size != n:
        flat = jnp.pad(flat, (0, chunk * size - n))
    if size > 1:
        # Reduce-scatter by data movement: device k receives chunk k of every device, in device
        # order, and reduces those D pieces by the top levels of the canonical tree.
        pieces = lax.all_to_all(flat.reshape(size, chunk), axis, 0, 0, tiled=True)
        part = _tree_rows(pieces)
    else:
        part = flat
    # All-gather the reduced chunks; the result is the same on every device (typed invariant).
    out = lax.all_gather(part, axis, axis=0, tiled=True, to="invarying")
    return out[:n].reshape(x.shape)


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
    x's dtype (float32 for device-count-invariant gradients). Any shape: the flattened size is
    zero-padded to a multiple of the device count. An axis of size 1 is the identity.
    """
    names = _axis_names(axis_name)
    size = math.prod(lax.axis_size(n) for n in names)
    _check_power_of_two(size, f"the size of mesh axis {axis_name!r}")
    return jax.tree.map(lambda leaf: _tree_psum_leaf(leaf, names, size), x)
