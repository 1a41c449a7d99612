"""Loading the native extension, registering its XLA FFI targets, and defining primitives.

Every jaxdet primitive is a `jax.extend.core.Primitive` whose abstract evaluation, per-platform
lowering and batching rule are declared next to each other in the primitive's own module. The
lowering names one FFI target; on CUDA, a build without CUDA kernels raises instead of quietly
running something else.

Inside ``jax.shard_map`` (``check_vma=True``) every output of a jaxdet primitive varies over the
union of the mesh axes its inputs vary over (docs/sharding.md), so the outputs keep their type:
``out_specs`` checks, ``lax.scan`` carries and ``custom_vjp`` cotangent types work as for JAX's own
primitives.
"""

from __future__ import annotations

import functools

import jax
from jax.extend import core as jex_core
from jax.interpreters import batching, mlir

from jaxdet import _native

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


def varying_axes(x) -> frozenset:
    """The mesh axes a value (or an abstract value) varies over inside ``jax.shard_map``."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _with_varying(aval, vma: frozenset):
    """`aval` typed as varying over `vma` (in the current shard_map's abstract mesh)."""
    if not vma or not isinstance(aval, jax.core.ShapedArray) or varying_axes(aval) == vma:
        return aval
    sharding = aval.sharding
    if sharding.mesh.empty:
        sharding = jax.sharding.NamedSharding(jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec())
    return aval.update(sharding=sharding, manual_axis_type=aval.mat.update(varying=vma))


def _propagate_varying(abstract_eval, multiple_results):
    # A kernel output depends on every input, so it varies wherever any input does (the union;
    # JAX's own rule would insist that the inputs agree, but an invariant weight next to a sharded
    # activation is the common case).
    def rule(*avals, **params):
        out = abstract_eval(*avals, **params)
        vma = frozenset().union(*(varying_axes(a) for a in avals))
        if not vma:
            return out
        if multiple_results:
            return type(out)(_with_varying(o, vma) for o in out)
        return _with_varying(out, vma)

    return rule


def define_primitive(target: str, abstract_eval, attributes, batching_rule=None, *, multiple_results=False,
                     operand_output_aliases=None):
    """A primitive named `target` that lowers to the FFI target of that name on cpu and cuda.

    `attributes(**params)` maps the primitive's parameters to the FFI call's attributes.
    `operand_output_aliases` is a dict {operand: result}, or a function of the operand count
    returning one (for variadic primitives such as clipping, whose aliases follow its leaves).
    """
    prim = jex_core.Primitive(target)
    prim.multiple_results = multiple_results
    prim.def_abstract_eval(_propagate_varying(abstract_eval, multiple_results))

    @functools.partial(jax.jit, static_argnames=("params",))
    def _jitted(*args, params):
        return prim.bind(*args, **dict(params))

    # Eager calls run through jit of the primitive, so eager and jit are the same compiled kernel.
    prim.def_impl(lambda *args, **params: _jitted(*args, params=tuple(sorted(params.items()))))

    def lowering(ctx, *args, **params):
        aliases = operand_output_aliases(len(args)) if callable(operand_output_aliases) else operand_output_aliases
        rule = jax.ffi.ffi_lowering(target, operand_output_aliases=aliases) if aliases else jax.ffi.ffi_lowering(target)
        return rule(ctx, *args, **attributes(**params))

    mlir.register_lowering(prim, lowering, platform="cpu")
    if target in CUDA_TARGETS:
        mlir.register_lowering(prim, lowering, platform="cuda")
    else:
        mlir.register_lowering(prim, _missing_cuda_lowering(target), platform="cuda")
    if batching_rule is not None:
        batching.primitive_batchers[prim] = batching_rule
    return prim


def not_mapped(dim) -> bool:
    """True for an operand that a batching rule receives unbatched (None in jax >= 0.10)."""
    return dim is None or dim is getattr(batching, "not_mapped", None)
