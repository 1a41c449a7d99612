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
from jax.sharding import AxisType, NamedSharding, reshard
from jax.sharding import PartitionSpec as P

from jaxdet._src.core.jaxprs import sub_jaxprs
from jaxdet._src.core.tree import axis_names, check_power_of_two, tree_psum, tree_sum
from jaxdet._src.core.varying import pcast_to_varying

__all__ = ["tree_psum", "tree_sum", "value_and_grad"]


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


# Primitives that communicate over a mesh axis. Inside loss_fn, over the data axis, any of them
# makes a leaf's loss depend on the other leaves or on the device count.
_COLLECTIVES = frozenset(
    {
        "psum",
        "psum2",
        "psum_invariant",
        "pmax",
        "pmin",
        "ppermute",
        "pshuffle",
        "pgather",
        "all_gather",
        "all_gather_invariant",
        "all_to_all",
        "reduce_scatter",
        "psum_scatter",
    }
)


def _collectives_over(jaxpr, names):
    """The names of collective primitives in `jaxpr` (and its sub-jaxprs) over any axis of `names`."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _COLLECTIVES:
            axes = eqn.params.get("axes", eqn.params.get("axis_name", ()))
            axes = axes if isinstance(axes, (tuple, list)) else (axes,)
            if any(a in names for a in axes):
                found.append(eqn.primitive.name)
        for sub in sub_jaxprs(eqn.params):
            found.extend(_collectives_over(sub, names))
    return found


def _check_no_data_axis_collectives(loss_fn, names, *args):
    """Refuses a loss_fn that reduces (or otherwise communicates) over the data axis."""
    found = _collectives_over(jax.make_jaxpr(loss_fn)(*args).jaxpr, names)
    if found:
        axis = names[0] if len(names) == 1 else names
        raise ValueError(
            f"loss_fn uses {', '.join(sorted(set(found)))} over the data axis {axis!r}: loss_fn sees one "
            "leaf of the batch and must not reduce over (or communicate along) the data axis; "
            "jaxdet.parallel.value_and_grad sums the leaves' losses and gradients itself, by the "
            "canonical tree (a psum or pmean inside loss_fn would count every leaf D times, or scale "
            "the result by the device count). Return this leaf's loss only."
        )


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
    names = axis_names(axis_name)
    size = _mesh_axis_size(mesh, names)
    check_power_of_two(size, f"the size of mesh axis {axis_name!r}")
    if not isinstance(leaves, int) or isinstance(leaves, bool):
        raise TypeError(f"leaves must be an int, got {type(leaves).__name__}")
    check_power_of_two(leaves, "leaves")
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
        leaf_batch0 = jax.tree.map(lambda x: x[:leaf_batch_size], batch)
        _check_no_data_axis_collectives(loss_fn, names, params_v, leaf_batch0, first, *args)

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
            init = jax.tree.map(lambda t: pcast_to_varying(jnp.zeros(t.shape, t.dtype), names), shapes)
        (loss, grads), aux = _local_tree(leaf, levels, first, init)
        loss, grads = tree_psum((loss, grads), names)
        grads = jax.tree.map(lambda g, p: g.astype(jnp.result_type(p)), grads, params)
        if has_aux:
            aux = jax.tree.map(
                lambda x: lax.all_gather(pcast_to_varying(x, names), spec_axis, axis=0, tiled=True, to="invarying"),
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
        if any(t == AxisType.Explicit for t in mesh.axis_types):
            # A mesh with explicit axes (jax.make_mesh's default) types every array's sharding:
            # shard_map then wants its inputs already laid out as in_specs says, so place them here
            # (the batch split over the data axis, the rest replicated).
            params, batch, *args = (
                jax.tree.map(lambda x, s=spec: reshard(x, NamedSharding(mesh, s)), tree)
                for tree, spec in zip((params, batch, *args), in_specs)
            )
        f = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())
        return f(params, batch, *args)

    return jax.jit(run)
