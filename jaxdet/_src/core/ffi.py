"""Loading the native extension, registering its XLA FFI targets, and defining primitives.

Every jaxdet primitive is a `jax.extend.core.Primitive` whose abstract evaluation, per-platform
lowering, batching rule and partitioning rule are declared next to each other in the primitive's
package (jaxdet/_src/<op>/). The lowering names one FFI target; on CUDA, a build without CUDA kernels raises instead
of quietly running something else.

Many devices (docs/sharding.md):

* Inside ``jax.shard_map`` (``check_vma=True``) every output of a jaxdet primitive varies over the
  union of the mesh axes its inputs vary over, so the outputs keep their type: ``out_specs`` checks,
  ``lax.scan`` carries and ``custom_vjp`` cotangent types work as for JAX's own primitives.
* Under ``jax.jit`` with sharded operands, a primitive with a `Partitioning` lowers through
  ``jax.experimental.custom_partitioning`` (a Shardy sharding rule, and the GSPMD callbacks when
  Shardy is off): each device runs the kernel on its own shards with no collective, except that
  a dimension that must not be split (a contraction) is all-gathered first, and a dimension the
  primitive sums over is combined across devices by the canonical tree (`tree_psum`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    SdyShardingRule,
    custom_partitioning,
)
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from jaxdet import _native
from jaxdet._src.core import varying

try:  # The set of primitives whose lowering needs the device assignment (custom partitioning does).
    from jax._src.dispatch import (
        prim_requires_devices_during_lowering as _NEEDS_DEVICES,
    )
except ImportError:  # pragma: no cover - a JAX without it lowers custom_partitioning without devices
    _NEEDS_DEVICES = set()

CPU_TARGETS = dict(_native.cpu_targets())
CUDA_TARGETS = dict(_native.cuda_targets())
WITH_CUDA = bool(_native.with_cuda)

for _name, _capsule in CPU_TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
for _name, _capsule in CUDA_TARGETS.items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


class CudaNotBuiltError(RuntimeError):
    """A jaxdet primitive was lowered for a GPU, but this build has no CUDA kernels."""


def _missing_cuda_lowering(target: str):
    def lowering(ctx, *args, **params):
        raise CudaNotBuiltError(
            f"{target}: this jaxdet build has no CUDA kernels (it was built without nvcc), so it cannot "
            "run on a GPU. Reinstall with the CUDA toolkit on PATH (JAXDET_CUDA=ON makes a missing "
            "nvcc a build error), or place the computation on the CPU with jax.default_device."
        )

    return lowering


def _propagate_types(abstract_eval, multiple_results, partitioning, result_varying=None):
    # A kernel output depends on every input, so it varies wherever any input does (the union;
    # JAX's own rule would insist that the inputs agree, but an invariant weight next to a sharded
    # activation is the common case), unless `result_varying(*avals)` names each result's axes.
    # With explicitly sharded operands (a mesh of AxisType.Explicit), each result dimension is
    # typed with its factor's sharding, as the partitioning rule will produce it.
    def rule(*avals, **params):
        out = abstract_eval(*avals, **params)
        outs = list(out) if multiple_results else [out]
        if partitioning is not None:
            shardings = _explicit_result_shardings(partitioning, params, avals)
            if shardings is not None:
                outs = [o.update(sharding=sh) for o, sh in zip(outs, shardings)]
        if result_varying is not None:
            outs = [varying.with_varying(o, frozenset(v)) for o, v in zip(outs, result_varying(*avals))]
        else:
            vma = varying.varying_union(*avals)
            if vma:
                outs = [varying.with_varying(o, vma) for o in outs]
        return type(out)(outs) if multiple_results else outs[0]

    return rule


def _explicit_result_shardings(part, params, avals):
    meshes = [a.sharding.mesh for a in avals if isinstance(a, jax.core.ShapedArray) and not a.sharding.mesh.empty]
    if not meshes or not any(t == jax.sharding.AxisType.Explicit for t in meshes[0].axis_types):
        return None
    mesh = meshes[0]
    shapes = [tuple(a.shape) for a in avals]
    axes = _assign_axes(part, params, mesh, shapes, [a.sharding.spec for a in avals])
    return [_sharding(mesh, axes, f) for f in part.factors(params, shapes)[1]]


# ---- Partitioning under sharded jit (custom_partitioning). ----


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """How a primitive runs on the shards of its operands under ``jax.jit``.

    ``factors(params, operand_shapes)`` names every dimension of every operand and result: one
    name per index space (``gemm``: ``a (l, m, k), b (l, k, n) -> (l, m, n)``). A dimension of an
    operand keeps its sharding when its factor can be split, and each result dimension takes its
    factor's sharding. The first operand that shards a factor decides its mesh axes; a mesh axis
    already taken, a split that does not divide the dimension, or a factor in ``replicated`` (a
    contraction: splitting it would need a ``psum``) leaves the factor whole, so the partitioner
    all-gathers it. A factor in ``reduced`` appears in no result: the primitive sums over it, and
    ``local`` must combine the devices' partial sums itself (by `tree_psum_untyped`).

    ``local(params, axes, operand_shapes)`` returns the function that runs on each device's shards
    (``axes``: factor -> tuple of mesh axes, major first, empty when nothing is split;
    ``operand_shapes``: the global shapes). None: the FFI call with the same parameters.
    ``can_split(factor, size, parts)``, when given, may refuse a split (a reduced factor whose
    shards would not line up with the canonical tree's subtrees).
    """

    factors: Callable
    replicated: frozenset = frozenset()
    reduced: frozenset = frozenset()
    local: Callable | None = None
    can_split: Callable | None = None


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _spec_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _assign_axes(part: Partitioning, params, mesh, shapes, specs):
    """factor -> mesh axes (major first), from the operands' partition specs."""
    operand_factors, _ = part.factors(params, shapes)
    axes, used = {}, set()
    for shape, spec, factors in zip(shapes, specs, operand_factors):
        spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
        for size, factor, entry in zip(shape, factors, spec):
            names = tuple(n for n in _spec_axes(entry) if mesh.shape[n] > 1)
            if not names or factor in axes or factor in part.replicated or used & set(names):
                continue
            parts = math.prod(mesh.shape[n] for n in names)
            if size % parts or (part.can_split is not None and not part.can_split(factor, size, parts)):
                continue
            axes[factor] = names
            used |= set(names)
    return axes


def _sharding(mesh, axes, factors):
    entries = [axes.get(f) for f in factors]
    return NamedSharding(mesh, PartitionSpec(*[None if not e else e[0] if len(e) == 1 else e for e in entries]))


def _specs_of(arg_shapes):
    specs = []
    for s in arg_shapes:
        sharding = s.sharding
        specs.append(sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec())
    return specs


def _shapes_of(values):
    return [tuple(v.shape) for v in values]


def _register_partitioned_lowering(prim, local, part: Partitioning, multiple_results: bool):
    """Lower `prim` through custom_partitioning. `local(params, axes, shapes)` is the per-device
    function; with no axes it computes the unsharded result, which is also what runs on one
    device and inside shard_map (where every mesh axis is manual)."""

    def fun(params, *args):
        out = local(dict(params), {}, _shapes_of(args))(*args)
        return list(out) if multiple_results else out

    cp = custom_partitioning(fun, static_argnums=(0,))

    def shardings(params, mesh, arg_shapes):
        shapes = _shapes_of(arg_shapes)
        axes = _assign_axes(part, params, mesh, shapes, _specs_of(arg_shapes))
        operand_factors, result_factors = part.factors(params, shapes)
        arg_shardings = tuple(_sharding(mesh, axes, f) for f in operand_factors)
        result_shardings = [_sharding(mesh, axes, f) for f in result_factors]
        return axes, shapes, arg_shardings, (result_shardings if multiple_results else result_shardings[0])

    def partition(params, mesh, arg_shapes, result_shape):
        axes, shapes, arg_shardings, result_shardings = shardings(dict(params), mesh, arg_shapes)
        body = local(dict(params), axes, shapes)

        def lower_fn(*args):
            # Per-device code: traced outside the caller's mesh context, so that an explicit mesh
            # (jax.set_mesh) adds no sharding annotations to what runs on one device's shards.
            with jax.sharding.use_abstract_mesh(_NO_MESH):
                out = body(*args)
            return list(out) if multiple_results else out

        return mesh, lower_fn, result_shardings, arg_shardings

    def infer_sharding_from_operands(params, mesh, arg_shapes, result_shape):
        return shardings(dict(params), mesh, arg_shapes)[3]

    def sharding_rule(params, mesh, value_types, result_types):
        operand_factors, result_factors = part.factors(dict(params), [tuple(t.shape) for t in value_types])
        # Shardy numbers the factors by first appearance and wants each special set in that order.
        order = list(dict.fromkeys(f for fs in [*operand_factors, *result_factors] for f in fs))
        return SdyShardingRule(
            tuple(ArrayMapping(*f) for f in operand_factors),
            tuple(ArrayMapping(*f) for f in result_factors),
            reduction_factors=tuple(f for f in order if f in part.reduced),
            need_replication_factors=tuple(f for f in order if f in part.replicated),
        )

    cp.def_partition(partition, infer_sharding_from_operands=infer_sharding_from_operands, sharding_rule=sharding_rule)

    def lowering(*args, **params):
        return cp(tuple(sorted(params.items())), *args)

    mlir.register_lowering(prim, mlir.lower_fun(lowering, multiple_results=multiple_results))
    _NEEDS_DEVICES.add(prim)


# ---- Defining primitives. ----


def lowers_with_devices(prim) -> None:
    """`prim`'s lowering may contain custom_partitioning calls that JAX cannot see in the jaxpr (a
    primitive lowered by a Python function): lower it with the device assignment."""
    _NEEDS_DEVICES.add(prim)


def shaped(shape, dtype):
    """The abstract value of a result: a ShapedArray of `shape` and `dtype`."""
    return jax.core.ShapedArray(tuple(shape), dtype)


def _new_primitive(name, abstract_eval, multiple_results, partitioning=None, result_varying=None):
    prim = jex_core.Primitive(name)
    prim.multiple_results = multiple_results
    prim.def_abstract_eval(_propagate_types(abstract_eval, multiple_results, partitioning, result_varying))

    @functools.partial(jax.jit, static_argnames=("params",))
    def _jitted(*args, params):
        return prim.bind(*args, **dict(params))

    # Eager calls run through jit of the primitive, so eager and jit are the same compiled kernel.
    prim.def_impl(lambda *args, **params: _jitted(*args, params=tuple(sorted(params.items()))))
    return prim


def define_primitive(
    target: str,
    abstract_eval,
    attributes,
    batching_rule=None,
    *,
    multiple_results=False,
    operand_output_aliases=None,
    partitioning: Partitioning | None = None,
    cuda_workspace: Callable | None = None,
    cpu_workspace: Callable | None = None,
    cuda_operand_output_aliases: Callable | None = None,
    result_varying: Callable | None = None,
):
    """A primitive named `target` that lowers to the FFI target of that name on cpu and cuda.

    `attributes(**params)` maps the primitive's parameters to the FFI call's attributes.
    `cuda_workspace(operand_avals, **params)`, when given, is the number of bytes of device memory
    the CUDA handler works in: its FFI call gets one more result, a uint8 buffer of that size that
    the primitive does not return. (XLA's scratch allocator would do, but a handler that uses it
    cannot run inside XLA's command buffers.) `cpu_workspace` is the same for the CPU handler.
    `operand_output_aliases` is a dict {operand: result}, or a function of the operand count
    returning one (for variadic primitives such as clipping, whose aliases follow its leaves).
    `cuda_operand_output_aliases(operand_avals, **params)`, when given, is the CUDA lowering's
    dict (or None) instead: aliases that only the CUDA kernels chosen for those shapes allow.
    `result_varying(*operand_avals)`, when given, is each result's set of varying mesh axes inside
    ``jax.shard_map`` (default: every result varies over the union of the operands' axes).
    With `partitioning`, the FFI call is a second primitive, ``prim.shard`` (named
    ``target + "_shard"``), that `partitioning.local` binds on each device's shards; its
    parameters are the FFI attributes' and may differ from the outer primitive's.
    """
    prim = _new_primitive(target, abstract_eval, multiple_results, partitioning, result_varying)
    ffi_prim = (
        prim
        if partitioning is None
        else _new_primitive(target + "_shard", abstract_eval, multiple_results, result_varying=result_varying)
    )

    def lower(ctx, args, params, aliases):
        rule = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases) if aliases else jax.ffi.ffi_lowering(target)
        return rule(ctx, *args, **attributes(**params))

    def default_aliases(n):
        return operand_output_aliases(n) if callable(operand_output_aliases) else operand_output_aliases

    def with_workspace(ctx, args, params, aliases, workspace_bytes):
        if workspace_bytes is None:
            return lower(ctx, args, params, aliases)
        size = max(int(workspace_bytes(ctx.avals_in, **params)), 1)
        workspace = jax.core.ShapedArray((size,), jnp.uint8)
        return lower(ctx.replace(avals_out=[*ctx.avals_out, workspace]), args, params, aliases)[:-1]

    def lowering(ctx, *args, **params):
        return with_workspace(ctx, args, params, default_aliases(len(args)), cpu_workspace)

    def cuda_lowering(ctx, *args, **params):
        if cuda_operand_output_aliases is None:
            aliases = default_aliases(len(args))
        else:
            aliases = cuda_operand_output_aliases(ctx.avals_in, **params)
        return with_workspace(ctx, args, params, aliases, cuda_workspace)

    mlir.register_lowering(ffi_prim, lowering, platform="cpu")
    if target in CUDA_TARGETS:
        mlir.register_lowering(ffi_prim, cuda_lowering, platform="cuda")
    else:
        mlir.register_lowering(ffi_prim, _missing_cuda_lowering(target), platform="cuda")
    if partitioning is not None:
        local = partitioning.local or (lambda params, axes, shapes: functools.partial(ffi_prim.bind, **params))
        _register_partitioned_lowering(prim, local, partitioning, multiple_results)
        prim.shard = ffi_prim
    if batching_rule is not None:
        batching.primitive_batchers[prim] = batching_rule
    return prim


def define_composite(
    name: str, abstract_eval, partitioning: Partitioning, batching_rule=None, *, multiple_results=False
):
    """A primitive computed by ``partitioning.local`` from other primitives, so that it can carry
    its own batching and partitioning rules."""
    prim = _new_primitive(name, abstract_eval, multiple_results, partitioning)
    _register_partitioned_lowering(prim, partitioning.local, partitioning, multiple_results)
    if batching_rule is not None:
        batching.primitive_batchers[prim] = batching_rule
    return prim


def define_lowered(name: str, abstract_eval, lowering, batching_rule=None, *, multiple_results=False):
    """A primitive lowered by ``lowering(*operands, **params)``, a function of other operations: for a
    ``custom_partitioning`` call that plans its own sharding (a pytree of leaves, each sharded its
    own way), where `Partitioning`'s one factor per dimension does not fit. The primitive carries
    the batching rule that ``custom_partitioning`` lacks."""
    prim = _new_primitive(name, abstract_eval, multiple_results)
    mlir.register_lowering(prim, mlir.lower_fun(lowering, multiple_results=multiple_results))
    _NEEDS_DEVICES.add(prim)
    if batching_rule is not None:
        batching.primitive_batchers[prim] = batching_rule
    return prim
