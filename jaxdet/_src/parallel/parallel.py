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
from jax import lax
from jax.sharding import PartitionSpec as P

__all__ = ["tree_psum", "tree_sum", "value_and_grad"]


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


def _varying(x, names):
    missing = tuple(n for n in names if n not in _varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x


def _as_summand(x, names):
    x = jnp.asarray(x)
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"tree_psum sums float (or integer) arrays, got {x.dtype}")
    # Like psum: a value not varying over an axis counts once per device of it.
    return _varying(x, names)


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
    names = _axis_names(axis_name)
    size = math.prod(lax.axis_size(n) for n in names)
    _check_power_of_two(size, f"the size of mesh axis {axis_name!r}")
    axis = names if len(names) > 1 else names[0]
    leaves, treedef = jax.tree.flatten(x)
    leaves = [_as_summand(leaf, names) for leaf in leaves]
    # One buffer per dtype and per set of other varying axes (which the result keeps); a leaf of
    # at least _OWN_BUFFER elements travels alone: packing it would copy it twice (concatenate,
    # slice) and hold every collective back until the last gradient exists.
    groups = {}
    for i, leaf in enumerate(leaves):
        alone = (i,) if leaf.size >= _OWN_BUFFER else ()
        groups.setdefault((leaf.dtype, _varying_axes(leaf) - set(names), alone), []).append(i)
    out = [None] * len(leaves)
    for members in groups.values():
        flats = [leaves[i].reshape(-1) for i in members]
        summed = _tree_psum_flat(jnp.concatenate(flats) if len(flats) > 1 else flats[0], axis, size)
        start = 0
        for i in members:
            out[i] = summed[start : start + leaves[i].size].reshape(leaves[i].shape)
            start += leaves[i].size
    return jax.tree.unflatten(treedef, out)


# ---- Data parallelism over leaves. ----


def _mesh_axis_size(mesh, names):
    shape = dict(mesh.shape)
    for n in names:
        if n not in shape:
            raise ValueError(f"axis_name {n!r} is not an axis of the mesh (axes: {tuple(shape)})")
    return math.prod(shape[n] for n in names)


def _local_tree(leaf_fn, levels, first, init):
    """The canonical subtree over 2**levels consecutive leaves from leaf `first` (a traced index).

    A loop of 2 iterations per level, the leaf body innermost and traced once: the leaf program is
    the same for any number of leaves per device, and one float32 running root per level plus the
    leaf being computed are live (log2(leaves per device) + 1 partials). `init` (zeros typed like a
    root) only fixes the loop carry's type. Per-leaf outputs that are not summed (aux) come back
    stacked in leaf order.
    """
    if levels == 0:
        return leaf_fn(first)
    half = 1 << (levels - 1)

    def body(root, i):
        part, stacked = _local_tree(leaf_fn, levels - 1, first + i * half, init)
        # First half: its root as it is (a select, no add); second: left + right.
        root = jax.tree.map(lambda r, p: jnp.where(i == 0, p, r + p), root, part)
        return root, stacked

    root, stacked = lax.scan(body, init, jnp.arange(2, dtype=jnp.int32))
    return root, jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), stacked)


def value_and_grad(loss_fn, *, mesh, axis_name, leaves, has_aux=False):
    """Loss and gradients over a global batch, bitwise the same on 1, 2, 4, ... devices.

    Args:
      loss_fn: ``loss_fn(params, leaf_batch, leaf_index, *args) -> loss`` (a float scalar), or
        ``-> (loss, aux)`` with ``has_aux``. It sees one leaf: ``leaf_batch`` is the batch pytree
        with a leading dim of ``global_batch // leaves`` and ``leaf_index`` is the leaf's global
        index (a traced int32 scalar), e.g. to key dropout by the global example index.
      mesh: the ``jax.sharding.Mesh`` to run on.
      axis_name: the mesh axis (or tuple of axes, first major) the batch is split over; its size D
        must be a power of two. Other mesh axes hold replicated copies.
      leaves: L, the number of leaves of the global batch: a power of two, at least D.
      has_aux: whether loss_fn returns ``(loss, aux)``.

    Returns ``f(params, batch, *args) -> (loss, grads)`` (``((loss, aux), grads)`` with has_aux),
    jitted, replicated on every device. ``batch`` is a pytree of arrays whose leading dim (the
    same for all, a multiple of L) is split into L equal leaves; device d holds leaves
    ``[d*L/D, (d+1)*L/D)``. ``args`` are passed to every leaf unchanged (replicated). Each leaf's
    loss and gradient are computed as if it were alone, cast to float32 (exact) and summed by the
    canonical tree over the leaf index (the device's leaves locally, then ``tree_psum``): ``loss``
    is the float32 sum of the leaf losses (for the mean over leaves multiply by 1/L, exact for a
    power of two); ``grads`` the float32 sum cast once to each parameter's dtype; ``aux`` the leaf
    auxes stacked in leaf order, ``[L, ...]``. None of these depends on D.
    """
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    names = _axis_names(axis_name)
    size = _mesh_axis_size(mesh, names)
    _check_power_of_two(size, f"the size of mesh axis {axis_name!r}")
    if not isinstance(leaves, int) or isinstance(leaves, bool):
        raise TypeError(f"leaves must be an int, got {type(leaves).__name__}")
    _check_power_of_two(leaves, "leaves")
    if leaves < size:
        raise ValueError(f"leaves must be at least the size of mesh axis {axis_name!r} ({size}), got {leaves}")
    per_device = leaves // size
    levels = per_device.bit_length() - 1
    spec_axis = names if len(names) > 1 else names[0]
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)

    def local(params, batch, *args):
        # Varying params: the per-leaf gradient stays this leaf's own (no reduction over devices
        # inside the VJP); the only cross-device sum is the tree_psum below.
        params_v = lax.pcast(params, names, to="varying")
        leaf_batch_size = jax.tree.leaves(batch)[0].shape[0] // per_device
        first = lax.axis_index(spec_axis) * per_device

        def leaf(index):
            offset = (index - first) * leaf_batch_size
            leaf_batch = jax.tree.map(lambda x: lax.dynamic_slice_in_dim(x, offset, leaf_batch_size, 0), batch)
            out, grads = grad_fn(params_v, leaf_batch, index, *args)
            loss, aux = out if has_aux else (out, None)
            summed = (
                jnp.asarray(loss, jnp.float32),
                jax.tree.map(lambda g: g.astype(jnp.float32), grads),
            )
            stacked = jax.tree.map(lambda x: jnp.expand_dims(x, 0), aux)
            return summed, stacked

        init = None
        if levels:
            shapes = jax.eval_shape(lambda: leaf(first)[0])
            init = jax.tree.map(lambda t: _varying(jnp.zeros(t.shape, t.dtype), names), shapes)
        (loss, grads), aux = _local_tree(leaf, levels, first, init)
        loss, grads = tree_psum((loss, grads), names)
        grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
        if has_aux:
            aux = jax.tree.map(
                lambda x: lax.all_gather(_varying(x, names), spec_axis, axis=0, tiled=True, to="invarying"),
                aux,
            )
            return (loss, aux), grads
        return loss, grads

    def run(params, batch, *args):
        sizes = {x.shape[0] if getattr(x, "ndim", 0) else None for x in jax.tree.leaves(batch)}
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"every array of batch needs the same leading (batch) dim, got {sorted(map(str, sizes))}")
        (batch_size,) = sizes
        if batch_size % leaves:
            raise ValueError(f"the batch's leading dim ({batch_size}) must be a multiple of leaves ({leaves})")
        in_specs = (P(), P(spec_axis), *(P() for _ in args))
        f = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())
        return f(params, batch, *args)

    return jax.jit(run)
