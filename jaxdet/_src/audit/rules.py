"""The rules of ``jaxdet.audit``: which JAX primitives can break batch invariance, run-to-run
determinism or device-count invariance on XLA:CPU and XLA:GPU, why, and what fixes them.

docs/audit.md states these rules; tests/test_audit.py proves them on models that have each problem.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from jaxdet._src.core.jaxprs import is_jaxdet, sub_jaxprs

# What a finding can break (its `breaks`).
BATCH = "batch"  # a row's bits depend on the batch it is in (its size, its position, the other rows)
RUN = "run-to-run"  # the same program on the same inputs can give other bits (atomics, autotuning)
DEVICES = "device-count"  # a sum over rows or devices whose order changes with the device count/micro-batching

_DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops=true (XLA_FLAGS): run-to-run only, not batch invariance"

# ---------------------------------------------------------------------------------------------
# Batch axes: the axes whose length changes with the batch. `audit` traces the function twice, with
# the batch arguments' leading axis at its size and at twice its size, and compares every
# equation's shapes; None where that comparison is not available (no batch_argnums, or the two
# traces differ in structure).


@dataclasses.dataclass(frozen=True)
class Axes:
    ins: tuple  # per operand: frozenset of batch axes, or None
    outs: tuple

    @property
    def known(self) -> bool:
        return all(m is not None for m in self.ins + self.outs)

    def batchy(self) -> bool:
        return any(m for m in self.ins + self.outs if m)


def _diff_axes(a1, a2):
    s1 = getattr(getattr(a1, "aval", None), "shape", None)
    s2 = getattr(getattr(a2, "aval", None), "shape", None)
    if s1 is None or s2 is None or len(s1) != len(s2):
        return None
    return frozenset(i for i, (x, y) in enumerate(zip(s1, s2)) if x != y)


def eqn_axes(e1, e2) -> Axes:
    if e2 is None:
        return Axes((None,) * len(e1.invars), (None,) * len(e1.outvars))
    return Axes(
        tuple(_diff_axes(a, b) for a, b in zip(e1.invars, e2.invars)),
        tuple(_diff_axes(a, b) for a, b in zip(e1.outvars, e2.outvars)),
    )


def same_structure(j1, j2) -> bool:
    return (
        j2 is not None
        and len(j1.eqns) == len(j2.eqns)
        and all(
            a.primitive.name == b.primitive.name and len(a.invars) == len(b.invars) for a, b in zip(j1.eqns, j2.eqns)
        )
    )


# ---------------------------------------------------------------------------------------------
# The rules: which primitives are hazards on which backend (docs/audit.md states them).

# Exact whatever the order or the shape: elementwise math, data movement, comparisons, max/min
# reductions, integer ops, key handling, state and sharding annotations.
_SAFE = set(
    """
    abs acos acosh add add_any and asin asinh atan atan2 atanh bessel_i0e bessel_i1e cbrt ceil clamp clz
    conj convert_element_type copy cos cosh digamma div eq eq_to erf erf_inv erfc exp exp2 expm1 floor ge
    gt igamma igamma_grad_a igammac imag integer_pow is_finite le le_to lgamma log log1p logistic lt lt_to
    max min mul mulhi ne neg nextafter not or polygamma population_count pow real reduce_precision rem
    round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
    sub tan tanh xor zeta regularized_incomplete_beta random_gamma_grad _copysign copysign reciprocal
    one_minus_square square_plus_one logistic_grad
    complex bitcast_convert_type iota broadcast_in_dim broadcast_to reshape transpose squeeze expand_dims
    rev slice dynamic_slice dynamic_update_slice concatenate pad gather select_and_gather_add split tile
    stack unstack stop_gradient optimization_barrier sharding_constraint reshard device_put mesh_cast
    layout_constraint shard_alike inspect_sharding pvary pcast pbroadcast preduced vary_unreduced_cast_p
    reduced_vary_cast_p all_gather all_gather_invariant all_to_all ragged_all_to_all ppermute psend precv
    axis_index axis_size pmax pmin reduce_max reduce_min reduce_and reduce_or reduce_xor reduce_window_max
    reduce_window_min argmax argmin cummax cummin top_k random_seed random_wrap random_unwrap random_split
    random_fold_in random_clone threefry2x32 threefry4x32 philox2x32 philox4x32 iota_2x32_shape
    create_token after_all debug_callback debug_print empty empty2 zeros_like tie get swap addupdate
    accum_grad_in_ref new_ref empty_ref free_ref freeze box_get box_set new_box pin unpin dce_sink name
    stage shape_assertion dimension_size dim_as_value to_edtype from_edtype unreachable
    lu_pivots_to_permutation log_extend log_read new_log
    """.split()
)
_DOTS = {"dot_general", "ragged_dot", "ragged_dot_general", "symmetric_product"}
_LINALG = {
    "cholesky",
    "cholesky_update",
    "eigh",
    "eig",
    "svd",
    "qr",
    "householder_product",
    "lu",
    "triangular_solve",
    "tridiagonal_solve",
    "tridiagonal",
    "schur",
    "hessenberg",
    "geqrf",
    "geqp3",
    "orgqr",
    "ormqr",
}
_PSUMS = {
    "psum",
    "psum_invariant",
    "psum_start",
    "psum_invariant_start",
    "reduce_scatter",
    "reduce_scatter_start",
    "unreduced_psum",
    "unreduced_psum_start",
    "unreduced_reduce_scatter",
    "unreduced_reduce_scatter_start",
    "all_gather_reduced",
    "all_gather_reduced_start",
    "all_reduce",
}
_ATTENTION = {
    "dot_product_attention_fwd",
    "dot_product_attention_bwd",
    "dot_product_attention_fwd_wrapper",
    "dot_product_attention_bwd_wrapper",
    "dot_product_attention_fp8_fwd",
    "dot_product_attention_fp8_bwd",
    "dot_product_attention_fp8_fwd_wrapper",
    "dot_product_attention_fp8_bwd_wrapper",
}
_UNSEEN = {
    "pallas_call",
    "ffi_call",
    "custom_call",
    "pure_callback",
    "io_callback",
    "tpu_custom_call",
    "triton_kernel_call",
    "cudnn_fusion",
    "custom_partitioning",
    "mosaic_gpu_call",
    "buffer_callback",
    "call_exported",
    "scaled_matmul",
    "scaled_matmul_wrapper",
    "scaled_dot",
}
_SOFTMAXES = {"softmax", "log_softmax", "_softmax", "_log_softmax", "_softmax_deprecated"}

_ATTENTION_FIX = (
    "jaxdet.attention(q, k, v) (fused; a query's output is the same in any batch, prefill chunk or KV-cache "
    "decode step), or jaxdet.matmul for QKᵀ and PV (batch dims allowed) with jaxdet.softmax"
)
_MATMUL_FIX = (
    "jaxdet.matmul(a, b) (rows invariant; its weight gradient follows jaxdet.matmul_weight_grad's chunk contract)"
)
_SEGMENT_FIX = (
    "jaxdet.embed(table, ids) for an embedding lookup (its table gradient is the canonical segment sum, "
    "bitwise jaxdet.matmul_weight_grad of the one-hot rows on the CPU, with no one-hot matrix), "
    "jaxdet.segment_sum for other segment sums"
)
_DROPOUT_FIX = (
    "jaxdet.dropout(x, key, rate, offset=...) with jaxdet.random keys: the mask is a function of "
    "(key, global element index, rate), identical on CPU and GPU, with an offset for micro-batches; "
    "per-example keys under vmap give each row its own mask"
)


@dataclasses.dataclass(frozen=True)
class Hit:
    kind: str
    breaks: tuple[str, ...]
    why: str
    fix: str
    blocking: bool = True


def _hit_if(kind, breaks, why, fix):
    """A Hit, or None where the operation breaks nothing (`breaks` is None)."""
    return None if breaks is None else Hit(kind, breaks, why, fix)


def _is_float(aval) -> bool:
    dt = getattr(aval, "dtype", None)
    try:
        return dt is not None and np.issubdtype(np.dtype(dt), np.inexact)
    except TypeError:  # extended dtypes (PRNG keys)
        return False


def _short(aval) -> str:
    try:
        return aval.str_short(short_dtypes=True)
    except Exception:  # noqa: BLE001 - aval printing differs across jax versions
        return str(aval)


def avals_str(eqn) -> str:
    ins = " x ".join(_short(a.aval) for a in eqn.invars if getattr(getattr(a, "aval", None), "shape", None) is not None)
    return f"{ins} -> {', '.join(_short(v.aval) for v in eqn.outvars)}"


def _axes_str(axes) -> str:
    return ", ".join(str(a) for a in sorted(axes))


_API_FIXES = (  # (substring of a function's name, the jaxdet op), first match wins
    ("attention", _ATTENTION_FIX),
    ("cross_entropy", "jaxdet.softmax_cross_entropy(logits, labels) (per-token losses, row-invariant fwd and bwd)"),
    ("log_softmax", "jaxdet.log_softmax(x)"),
    ("logsumexp", "jaxdet.log_softmax(x)"),
    ("softmax", "jaxdet.softmax(x)"),
    ("rms", "jaxdet.rms_norm(x, scale, eps)"),
    ("layer_norm", "jaxdet.layer_norm(x, scale, bias, eps)"),
    ("layernorm", "jaxdet.layer_norm(x, scale, bias, eps)"),
    ("global_norm", "jaxdet.clip_by_global_norm / jaxdet.global_norm (jaxdet.optax.clip_by_global_norm in optax)"),
)


def _api_fix(apis: Sequence[str], function: str) -> str | None:
    """The jaxdet op that replaces the library function an equation comes from (the outermost one
    first), else the one the user's enclosing function is named after."""
    for name in [a.rsplit(".", 1)[-1].split(":")[-1].lower() for a in apis] + [(function or "").lower()]:
        for key, fix in _API_FIXES:
            if key in name:
                return fix
    return None


def _with_run(fix: str, gpu_run: bool) -> str:
    return fix + (f"; run-to-run only: {_DETERMINISTIC_FLAG}" if gpu_run else "")


def _reduce_hit(eqn, axes: Axes, apis, function, backend, backward) -> Hit | None:
    x = eqn.invars[0]
    if not _is_float(x.aval):
        return None
    shape = tuple(x.aval.shape)
    red = set(eqn.params.get("axes", eqn.params.get("dimensions", ())))
    n = int(np.prod([shape[a] for a in red])) if red else 1
    if n <= 2:
        return None  # a + b == b + a: at most two terms are exact in any order
    gpu = backend == "gpu"
    row_reduction = (len(shape) - 1) in red
    long = gpu and n > (16384 if row_reduction else 4096)
    bx = axes.ins[0]
    across = bx is not None and bool(bx & red)
    within = bx is not None and bool(bx) and not across
    desc = f"sums {n} elements over axis {_axes_str(red)} of {_short(x.aval)}"
    if across:
        desc += f" (across rows: axis {_axes_str(bx & red)} grows with the batch)"
    elif within:
        desc += f" (within rows: the batch is axis {_axes_str(bx)})"
    if gpu:
        order = (
            "XLA:GPU's reduction emitter picks its tiling and how the reduced axis is split over threads from "
            "the whole shape"
        )
        if long:
            bound = "16384 for a row" if row_reduction else "4096 for a column"
            order += (
                f"; {n} terms exceed XLA's race-free bound ({bound} reduction), so partial sums may be "
                "combined with atomics or by a rewritten tree"
            )
    else:
        order = (
            "XLA:CPU vectorizes reductions and rewrites long ones into a tree (TreeReductionRewriter) from the "
            "whole shape"
        )
    fix = _api_fix(apis, function)
    if across:
        breaks = (DEVICES, RUN) if long else (DEVICES,)
        why = (
            f"{desc}: the result depends on every row by design, but the order of the additions is XLA's "
            f"({order}), so splitting the batch into micro-batches or over devices changes its bits"
        )
        fix = fix or (
            "a sum in an order you fix: jaxdet.parallel.tree_sum over per-row or per-micro-batch values "
            "(the canonical tree, device-count invariant), or jaxdet.sum / jaxdet.bias_add's gradient "
            "(token chunks of 8192 in order, then the tree)"
        )
    elif within or bx is None:
        breaks = (BATCH, RUN) if long else (BATCH,)
        why = f"{desc}: {order}, so a row's bits can change with the batch size"
        if bx is None:
            breaks += (DEVICES,)
            why += (
                "; if the reduced axis carries rows, the sum also changes with micro-batching and the device "
                "count (pass batch_argnums to tell)"
            )
        fix = fix or (
            "the jaxdet op it implements (rms_norm, layer_norm, softmax, log_softmax, "
            "softmax_cross_entropy); any other sum as jaxdet.sum (any axes, the canonical chunk rule), a bias as "
            "jaxdet.bias_add"
        )
    elif long:
        breaks = (RUN,)
        why = f"{desc}, which does not depend on the batch; but {order}"
        fix = fix or "pieces within the bound, summed in an order you fix"
        return Hit("reduce", breaks, why, _with_run(fix, True))
    else:
        return None
    if backward and eqn.primitive.name == "reduce_sum" and any(a.rsplit(".", 1)[-1] in _SOFTMAXES for a in apis):
        also = (
            "; on a GPU this backward also changes run to run (atomics; docs/audit.md has measurements)" if gpu else ""
        )
        return Hit(
            "softmax-backward",
            breaks if RUN in breaks or not gpu else breaks + (RUN,),
            f"the backward of softmax/log_softmax reduces each row of the cotangent: {why}{also}",
            _with_run(fix, gpu),
        )
    return Hit("reduce", breaks, why, _with_run(fix, long))


def _batch_breaks(axes: Axes, gpu_run: bool, across: bool = False) -> tuple[str, ...] | None:
    """BATCH when a shape depends on the batch (or unknown), DEVICES when rows are summed, RUN on a
    GPU where the op is not run-to-run deterministic; None when nothing breaks."""
    breaks = ()
    if across:
        breaks = (DEVICES,)
    elif not axes.known or axes.batchy():
        breaks = (BATCH,)
    if gpu_run:
        breaks += (RUN,)
    return breaks or None


def _dropout_hit(eqn, axes: Axes, offset_fixed: bool) -> Hit | None:
    """jaxdet.dropout's mask is a function of (key, global element index, rate): with one key for
    a batch-shaped array, element (i, j) is indexed by its position in this array plus `offset`,
    so a row's mask follows its position in the batch unless the offset places it."""
    x, keys = eqn.invars[0].aval, eqn.invars[1].aval
    groups = len(keys.shape) - 1  # keys [*G, 2]: G > 0 when vmapped over per-example keys
    if groups > 0 or len(x.shape) == 0 or not offset_fixed:
        return None  # per-example keys, or an offset computed at run time (the caller places the rows)
    if axes.known and not axes.batchy():
        return None
    why = (
        "jaxdet.dropout with one key for a batch-shaped array: element (i, j) draws the mask bit of its "
        "flat index in this array plus `offset`, so a row's mask depends on its position in the batch "
        "(a row alone, a micro-batch or a device shard draws other bits) unless `offset` is the global "
        "index of the array's first element"
    )
    fix = (
        "an offset by the global example index, jaxdet.dropout(x, key, rate, offset=first_row * row_size) "
        "for a micro-batch or shard starting at global row first_row (docs/dropout.md), or one key per "
        "example (jax.vmap over jaxdet.random.fold_in(key, example_index))"
    )
    return Hit("rng", (BATCH,), why, fix)


def classify(eqn, axes: Axes, apis, function, backend, backward, fixed=()) -> Hit | None:
    """The hazard of `eqn`, or None. `fixed[i]`: operand i is fixed when the program is traced."""
    name = eqn.primitive.name
    p = eqn.params
    gpu = backend == "gpu"
    if name == "jaxdet_dropout":
        return _dropout_hit(eqn, axes, offset_fixed=len(fixed) > 2 and fixed[2])
    if is_jaxdet(eqn):
        return None
    if name in _SAFE:
        return None
    in_float = any(_is_float(getattr(a, "aval", None)) for a in eqn.invars)
    in_float = in_float or any(_is_float(v.aval) for v in eqn.outvars)

    if name in _DOTS:
        if not in_float:
            return None
        k, across = 2, False
        dn = p.get("dimension_numbers")
        try:
            (lc, rc), _ = dn
            k = int(np.prod([eqn.invars[0].aval.shape[a] for a in lc])) if lc else 1
            across = bool((axes.ins[0] or set()) & set(lc)) or bool((axes.ins[1] or set()) & set(rc))
        except (TypeError, IndexError, ValueError, AttributeError):
            pass
        if name == "dot_general" and k <= 1:
            return None  # an outer product: one exact multiply per element
        breaks = _batch_breaks(axes, gpu, across)
        if breaks is None:
            return None
        attention = any("attention" in a for a in apis)
        why = f"a GEMM with contraction length {k} by " + (
            "cuBLAS(Lt) or a Triton fusion, whose tiling and split-K XLA's autotuner picks from the whole shape "
            "(so the choice can also differ between compilations)"
            if gpu
            else "Eigen/XLA:CPU, whose blocking and GEMV/GEMM paths depend on the number of rows"
        )
        if across:
            why = "contracts over rows (a weight gradient): " + why
        elif axes.known and not axes.batchy():
            why = "its shapes do not depend on the batch, but " + why
        return Hit(
            "attention" if attention else "dot",
            breaks,
            why,
            _with_run(_ATTENTION_FIX if attention else _MATMUL_FIX, gpu),
        )

    if name == "conv_general_dilated":
        if not in_float:
            return None
        breaks = _batch_breaks(axes, gpu)
        if breaks is None:
            return None
        why = "a convolution by " + (
            "cuDNN, whose algorithm XLA's autotuner picks from the whole shape; some "
            "algorithms (backward data/filter) accumulate with atomics"
            if gpu
            else "Eigen/oneDNN, whose blocking depends on the batch size"
        )
        return Hit(
            "conv",
            breaks,
            why,
            _with_run(
                "no jaxdet convolution yet: lax.conv_general_dilated_patches, then jaxdet.matmul of the patches "
                "with the reshaped kernel",
                gpu,
            ),
        )

    if name in _ATTENTION:
        return Hit(
            "attention",
            _batch_breaks(axes, True) or (RUN,),
            "cuDNN fused attention: its kernel choice and the backward's dQ/dK/dV accumulation are cuDNN's, "
            "chosen for the whole shape",
            _with_run(_ATTENTION_FIX + " (implementation='xla' still runs jnp einsums)", True),
        )

    if name in ("reduce_sum", "reduce_prod", "reduce"):
        if name == "reduce" and not _accumulates(p):
            return None  # a max/min/argmax written with lax.reduce
        return _reduce_hit(eqn, axes, apis, function, backend, backward)

    if name in ("reduce_window_sum", "reduce_window"):
        window = int(np.prod(p.get("window_dimensions", (3,))))
        if not in_float or window <= 2 or (name == "reduce_window" and not _accumulates(p)):
            return None
        breaks = _batch_breaks(axes, False)
        return _hit_if(
            "reduce",
            breaks,
            "a windowed float sum (pooling) whose loop XLA emits from the whole shape",
            "jaxdet.matmul of the windows (lax.conv_general_dilated_patches) with a ones vector",
        )

    if name in ("cumsum", "cumprod", "cumlogsumexp"):
        if not in_float:
            return None
        ax = p.get("axis", 0)
        across = axes.ins[0] is not None and ax in axes.ins[0]
        breaks = _batch_breaks(axes, False, across)
        if breaks is None:
            return None
        how = "a CUB scan or a reduce-window tree" if gpu else "a reduce-window that XLA rewrites into a tree"
        return Hit(
            "cumulative",
            breaks,
            f"a float prefix {name[3:]} along axis {ax}"
            + (" (the batch axis: each row adds up the rows before it)" if across else "")
            + f", lowered to {how} that depends on the array's shape: position t's bits can change with the "
            "scanned length (prefill vs decode, padding) and the batch",
            "a sequential lax.scan along the axis, or jaxdet.matmul(jnp.tril(ones[S, S]), x) (every prefix "
            "summed in ascending order)",
        )

    if name.startswith("scatter") or name in ("select_and_scatter_add", "select_and_scatter"):
        return _scatter_hit(eqn, axes, name, in_float, gpu)

    if name in _PSUMS:
        if not in_float:
            return None
        return Hit(
            "collective",
            (DEVICES,),
            f"{name} across devices: the order of the sum is the collective's (XLA's all-reduce or NCCL's "
            "ring/tree/NVLS schedule for this message size, topology and device count), so its bits change "
            "with the number of devices",
            "jaxdet.parallel.tree_psum(x, axis_name) (the canonical tree over the device index, data "
            "movement only: the same bits for 1, 2, 4, ... devices)",
        )

    if name in ("random_bits", "rng_bit_generator", "rng_uniform", "random_gamma"):
        return _rng_hit(eqn, axes, name)

    if name in _LINALG or name == "fft":
        if not in_float:
            return None
        breaks = _batch_breaks(axes, False)
        lib = (
            "DUCC/cuFFT: the plan is made for the whole batched transform"
            if name == "fft"
            else (
                "LAPACK/cuSOLVER: batched and single problems can take different algorithms (e.g. batched Jacobi for "
                "small matrices on a GPU)"
            )
        )
        return _hit_if(
            "linalg",
            breaks,
            f"{name} by {lib}",
            "no jaxdet equivalent: keep it out of the reproducible path, or run it with a fixed batch shape",
        )

    if name == "sort":
        if p.get("is_stable", True) or len(eqn.invars) <= p.get("num_keys", 1):
            return None
        breaks = _batch_breaks(axes, gpu)
        return _hit_if(
            "sort",
            breaks,
            "an unstable sort carrying payloads: the order of equal keys depends on the algorithm, "
            "its size and the backend",
            "is_stable=True (jnp.argsort and lax.sort with stable ordering)",
        )

    if name == "approx_top_k":
        breaks = _batch_breaks(axes, False)
        return _hit_if(
            "sort",
            breaks,
            "approximate top-k: which elements it keeps depends on the whole shape",
            "lax.top_k (exact; ties go to the lower index)",
        )

    if name not in _UNSEEN and sub_jaxprs(p):
        return None  # a call or control flow: the walk visits its body
    return Hit(
        "unverified",
        (),
        f"{name}: a primitive the audit does not know or cannot look into (a custom "
        "kernel, callback or new JAX primitive); its determinism is its author's contract",
        f"check it with jaxdet.testing.assert_batch_invariant / assert_deterministic, then ignore=[{name!r}]",
        blocking=False,
    )


def opaque(eqn) -> bool:
    """Kernels whose inner jaxpr is not XLA's program (Pallas, custom calls): not walked into."""
    return eqn.primitive.name in _UNSEEN


def _accumulates(params) -> bool:
    """Whether a reduction's combiner adds or multiplies (order-dependent in floats)."""
    return any(e.primitive.name in ("add", "add_any", "sub", "mul") for j in sub_jaxprs(params) for e in j.eqns)


def _scatter_hit(eqn, axes: Axes, name, in_float, gpu) -> Hit | None:
    p = eqn.params
    if not in_float:
        return None
    if name.startswith("select_and_scatter"):
        breaks = _batch_breaks(axes, gpu)
        return _hit_if(
            "scatter",
            breaks,
            "the gradient of max pooling: overlapping windows add into the same input element"
            + ("; XLA:GPU has no deterministic select-and-scatter" if gpu else ""),
            "non-overlapping windows (stride == window), or pooling written with jaxdet.matmul",
        )
    if p.get("unique_indices"):
        return None
    combiner = name.split("-", 1)[1] if "-" in name else name[len("scatter_") :] if "_" in name else ""
    local = _row_local(eqn, axes)
    across = not local and (axes.ins[2] if len(axes.ins) > 2 else None) != frozenset()
    if combiner in ("add", "mul", "sub"):
        what = (
            f"scatter-{combiner} with possibly repeated indices (e.g. the gradient of an embedding lookup "
            "jnp.take / x[idx], .at[].add, segment_sum)"
        )
        if gpu:
            return Hit(
                "scatter",
                (RUN, DEVICES) if across else (RUN,),
                f"{what}: XLA:GPU combines the updates with atomics, in whatever order threads arrive",
                _with_run(_SEGMENT_FIX, True) + " (a sort-based deterministic scatter)",
            )
        if not across:
            return None  # each row's updates land in that row only, applied in update order
        return Hit(
            "scatter",
            (DEVICES,),
            f"{what}: XLA:CPU applies the updates one by one in update order (deterministic here), so a "
            "repeated index sums over the rows in batch order, and micro-batching or devices change it; on a "
            "GPU it uses atomics",
            _SEGMENT_FIX,
        )
    if combiner == "" and gpu:
        return Hit(
            "scatter",
            (RUN,),
            "a scatter with possibly repeated indices: on a GPU, which update wins is a race",
            _with_run("unique indices (pass unique_indices=True when they are)", True),
        )
    return None


def _row_local(eqn, axes: Axes) -> bool:
    """Whether every batch axis of a scatter's updates lands in the same row of the operand (a
    window dimension onto an operand batch axis, or a batching dimension): then no two rows' updates
    meet (e.g. the gradient of take_along_axis in a cross-entropy)."""
    try:
        dn = eqn.params["dimension_numbers"]
        op_b, upd_b = axes.ins[0], axes.ins[2]
        if op_b is None or upd_b is None:
            return False
        n_op, n_idx, n_upd = (_ndim(eqn.invars[k]) for k in range(3))
        op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
        idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
        window_op = [d for d in range(n_op) if d not in dn.inserted_window_dims and d not in op_batching]
        window = dict(zip(dn.update_window_dims, window_op))
        scatter_dims = [d for d in range(n_upd) if d not in dn.update_window_dims]
        to_index = dict(zip(scatter_dims, range(max(n_idx - 1, 0))))  # JAX's index vector is the last axis
        index_to_op = dict(zip(idx_batching, op_batching))
        for b in upd_b:
            target = window.get(b, index_to_op.get(to_index.get(b, -1)))
            if target is None or target not in op_b:
                return False
        return True
    except (AttributeError, KeyError, IndexError, TypeError):
        return False


def _ndim(atom) -> int:
    return len(getattr(getattr(atom, "aval", None), "shape", ()) or ())


def _rng_hit(eqn, axes: Axes, name) -> Hit | None:
    key = eqn.invars[0] if eqn.invars else None
    key_dtype = str(getattr(getattr(key, "aval", None), "dtype", ""))
    key_shape = tuple(getattr(getattr(key, "aval", None), "shape", ()) or ())
    rbg = name in ("rng_bit_generator", "rng_uniform") or "rbg" in key_dtype
    if rbg:
        return Hit(
            "rng",
            _batch_breaks(axes, False) or (BATCH,),
            f"{name} ({key_dtype or 'XLA RngBitGenerator'}): XLA's RngBitGenerator, whose bits are defined "
            "per backend and per shape (not the same on CPU and GPU, nor guaranteed across JAX versions)",
            _DROPOUT_FIX,
        )
    if axes.known and not axes.batchy():
        return None  # the same bits whatever the batch: threefry is a pure function of (key, shape)
    partitionable = bool(getattr(jax.config, "jax_threefry_partitionable", True))
    if not partitionable:
        why = (
            "threefry bits with jax_threefry_partitionable=False: every element's bits depend on the whole "
            "array's shape, so a row's mask changes with the batch size"
        )
    elif key_shape and axes.known and axes.ins[0]:
        return None  # one key per example (vmap): each row's bits depend on its key only
    else:
        why = (
            "threefry bits from one key for the whole array: element (i, j) gets the bits of its flat index, so a "
            "row's mask depends on its position in the batch (alone it gets row 0's) and on the global flag "
            "jax_threefry_partitionable; nothing reproduces one micro-batch's share"
        )
    return Hit("rng", (BATCH,), why, _DROPOUT_FIX)
