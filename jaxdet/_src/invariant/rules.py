"""Per-primitive rules of `jaxdet.invariant`: which operations are bound again as they are, which are
replaced by their canonical form, and which are refused (with the reason the error gives).

An operation is bound again only where no order of floating-point operations is left open:
elementwise arithmetic (one result from one set of operands), data movement, integer and boolean
arithmetic (exact in any order), and jaxdet's own primitives. Floating-point reductions follow
the canonical rule (docs/invariant.md): products and sums through jaxdet's kernels, max/min
through an exact integer order, scatter-adds through the canonical segment sum, collectives
through the canonical tree.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxdet._src.core import tree
from jaxdet._src.core.jaxprs import is_jaxdet

# Bound again as they are: each output element is one function of its operands (no reduction
# order exists), or the operation moves data, or it is jaxdet's own.
EXACT = frozenset(
    """
    abs acos acosh and asin asinh atan atan2 atanh bessel_i0e bessel_i1e
    bitcast_convert_type cbrt ceil clamp clz complex conj convert_element_type copy copy_p cos cosh
    digamma eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igamma_grad_a igammac imag
    integer_pow is_finite le lgamma log log1p logistic lt max min mul ne neg nextafter not or
    polygamma population_count pow real reduce_precision regularized_incomplete_beta rem round
    rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh sqrt square
    tan tanh xor zeta
    broadcast_in_dim concatenate dynamic_slice dynamic_update_slice expand_dims gather iota pad
    reshape rev slice split squeeze transpose stack unstack tile broadcast_to zeros_like mulhi
    layout_constraint with_memory_space_constraint
    argmax argmin reduce_and reduce_or reduce_xor
    sharding_constraint device_put reshard mesh_cast optimization_barrier name stop_gradient
    all_gather all_gather_invariant all_to_all ppermute axis_index pvary pbroadcast pcast
    random_seed random_wrap random_unwrap random_split random_fold_in
    create_token after_all debug_callback empty2
    """.split()
)

# Refused, with the reason (the user's source line is added by the interpreter).
REFUSED = {
    "conv_general_dilated": "is a convolution, whose reduction order XLA chooses (no canonical rule yet)",
    "fft": "is an FFT, whose operation order the library chooses",
    "sort": "is a sort (sort-based operations are not covered)",
    "top_k": "is a sort-based selection (not covered)",
    "approx_top_k": "is an approximate selection (not covered)",
    "random_bits": "draws random bits whose values depend on the shape drawn, so on the batch; "
    "use jaxdet.dropout or keys from jaxdet.random (docs/dropout.md)",
    "threefry2x32": "draws random bits outside jaxdet (use jaxdet.dropout / jaxdet.random)",
    "rng_bit_generator": "draws random bits outside jaxdet (use jaxdet.dropout / jaxdet.random)",
    "rng_uniform": "draws random numbers outside jaxdet (use jaxdet.dropout / jaxdet.random)",
    "random_gamma": "draws random numbers outside jaxdet",
    "reduce_window_sum": "is a windowed sum in XLA's order (not covered)",
    "reduce_window": "is a windowed reduction in XLA's order (not covered)",
    "reduce_window_max": "is a windowed max (not covered)",
    "reduce_window_min": "is a windowed min (not covered)",
    "select_and_scatter_add": "is a windowed scatter-add (the gradient of a max-pool; not covered)",
    "select_and_gather_add": "is a windowed gather-add (not covered)",
    "pure_callback": "calls an opaque host function",
    "io_callback": "calls an opaque host function",
    "cholesky": "is a factorisation whose operation order the library chooses",
    "eig": "is a factorisation whose operation order the library chooses",
    "eigh": "is a factorisation whose operation order the library chooses",
    "svd": "is a factorisation whose operation order the library chooses",
    "qr": "is a factorisation whose operation order the library chooses",
    "lu": "is a factorisation whose operation order the library chooses",
    "triangular_solve": "is a solve whose operation order the library chooses",
    "custom_linear_solve": "is a solve whose operation order the library chooses",
    "reduce": "is a general reduction with a user computation (no canonical rule)",
}


def is_float(dtype) -> bool:
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _bind(eqn, invals):
    return eqn.primitive.bind(*invals, **eqn.params)


def _out_dtype(eqn, i=0):
    return eqn.outvars[i].aval.dtype


# ---- Adds: no multiply is contracted into them ----
# XLA:CPU lets LLVM fuse a multiply and an add of one fused loop into one FMA, so `a * b + c`
# would round once or twice depending on fusion decisions (which depend on shapes). Each float
# operand of an add or subtract passes through an identity no compiler can see through (its bits
# xor a zero computed at run time by a jaxdet kernel), so it is rounded to its dtype before the
# add on every backend. (XLA:GPU already emits separately rounded operations.)

_ZEROS: list = []  # one run-time zero per program being evaluated (interpreter.evaluate)


def enter_program():
    _ZEROS.append(None)


def exit_program():
    _ZEROS.pop()


_UINT_OF = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _runtime_zero(itemsize):
    """This program's run-time zero as an unsigned integer of `itemsize` bytes (made once each)."""
    if _ZEROS[-1] is None:
        from jaxdet._src.reduce import reduce as canonical

        # The sum of one +0: opaque to XLA (a custom call) and to LLVM (a value loaded from memory).
        z = canonical.reduce_sum(jnp.zeros((1,), jnp.float32), (0,), np.dtype(np.float32))
        _ZEROS[-1] = {4: lax.bitcast_convert_type(z, jnp.uint32)}
    zeros = _ZEROS[-1]
    if itemsize not in zeros:
        zeros[itemsize] = zeros[4].astype(_UINT_OF[itemsize])
    return zeros[itemsize]


def runtime_value(x):
    """x, as a value XLA cannot fold or reassociate (floats only; others as they are)."""
    if not is_float(getattr(x, "dtype", None)):
        return x
    return _rounded(jnp.asarray(x))


def _rounded(x):
    if not is_float(x.dtype) or not _ZEROS:
        return x
    size = np.dtype(x.dtype).itemsize
    bits = lax.bitcast_convert_type(x, _UINT_OF[size])
    return lax.bitcast_convert_type(bits ^ _runtime_zero(size), x.dtype)


def _add(eqn, *xs, unsupported=None):
    return _bind(eqn, [_rounded(x) for x in xs])


def _div(eqn, x, y, unsupported=None):
    """XLA's simplifier rewrites a division by a broadcast value into a multiply by the broadcast
    reciprocal (other bits) in some compilations and not others (a shard_map's partitioned module).
    The divisor's bits are or-ed with (the dividend's bits and a run-time zero): the same bits, but
    an array XLA cannot see as a broadcast, so the division stays a division."""
    if not (is_float(x.dtype) and is_float(y.dtype) and _ZEROS):
        return _bind(eqn, [x, y])
    x, y = jnp.asarray(x), jnp.asarray(y)
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    size = np.dtype(y.dtype).itemsize  # lax.div's operands share one dtype
    xbits = lax.bitcast_convert_type(jnp.broadcast_to(x, shape), _UINT_OF[size])
    ybits = lax.bitcast_convert_type(jnp.broadcast_to(y, shape), _UINT_OF[size])
    y = lax.bitcast_convert_type(ybits | (xbits & _runtime_zero(size)), y.dtype)
    return _bind(eqn, [_rounded(x), y])


# ---- Sums ----


def _reduce_sum(eqn, x):
    if not is_float(x.dtype):
        return _bind(eqn, [x])
    from jaxdet._src.reduce import reduce as canonical

    return canonical.reduce_sum(x, tuple(eqn.params["axes"]), np.dtype(_out_dtype(eqn)))


def _refuse_float(reason):
    def rule(eqn, x, *rest, unsupported=None):
        if is_float(x.dtype):
            raise unsupported(eqn, reason)
        return _bind(eqn, [x, *rest])

    return rule


# ---- Max and min: an exact order on the float's bits ----
# Max and min are exact in any order except for signed zeros and NaNs: the canonical result has
# +0 > -0, and a NaN anywhere gives the canonical quiet NaN. The values are mapped to integers of
# their width in that order (sign-magnitude to two's complement), reduced exactly, mapped back.

_INT_OF = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}


def _key(x):
    itype = _INT_OF[np.dtype(x.dtype).itemsize]
    bits = lax.bitcast_convert_type(x, itype)
    flip = jnp.array(np.iinfo(itype).max, itype)
    return jnp.where(bits < 0, bits ^ flip, bits)


def _unkey(k, dtype):
    flip = jnp.array(np.iinfo(k.dtype).max, k.dtype)
    return lax.bitcast_convert_type(jnp.where(k < 0, k ^ flip, k), dtype)


def _canonical_extreme(x, reduce_keys, reduce_any, is_max):
    nan = jnp.isnan(x)
    # NaNs are set aside (any NaN makes the result NaN); infinities keep their place.
    fill = -jnp.inf if is_max else jnp.inf
    k = reduce_keys(_key(jnp.where(nan, jnp.array(fill, x.dtype), x)))
    return jnp.where(reduce_any(nan), jnp.array(jnp.nan, x.dtype), _unkey(k, x.dtype))


def _reduce_extreme(is_max):
    def rule(eqn, x, unsupported=None):
        if not is_float(x.dtype):
            return _bind(eqn, [x])
        axes = tuple(eqn.params["axes"])
        red = lax.reduce_max if is_max else lax.reduce_min
        return _canonical_extreme(x, lambda k: red(k, axes), lambda m: lax.reduce_or(m, axes), is_max)

    return rule


def _cumulative_extreme(is_max):
    def rule(eqn, x, unsupported=None):
        if not is_float(x.dtype):
            return _bind(eqn, [x])
        p = eqn.params
        axis, reverse = p["axis"], p["reverse"]
        cum = lax.cummax if is_max else lax.cummin

        def keys(k):
            return cum(k, axis=axis, reverse=reverse)

        def any_nan(m):
            return lax.cummax(m.astype(jnp.int8), axis=axis, reverse=reverse).astype(bool)

        return _canonical_extreme(x, keys, any_nan, is_max)

    return rule


def _collective_extreme(is_max):
    def rule(eqn, x, unsupported=None):
        if not is_float(x.dtype):
            return _bind(eqn, [x])
        axes = _collective_axes(eqn, unsupported)
        red = lax.pmax if is_max else lax.pmin
        return _canonical_extreme(
            x, lambda k: red(k, axes), lambda m: lax.pmax(m.astype(jnp.int8), axes).astype(bool), is_max
        )

    return rule


# ---- Products ----


def _operands_as_computed(lhs, rhs, precision):
    """The operands in the dtype the product computes in: the one a dot algorithm names
    (`BF16_BF16_F32` rounds both to bfloat16, as JAX's derivatives of mixed products ask), else,
    for mixed dtypes, the wider one (an exact widening)."""
    name = str(getattr(precision, "name", precision) or "")
    for prefix, dtype in (("BF16_BF16", jnp.bfloat16), ("F16_F16", jnp.float16), ("F32_F32", jnp.float32)):
        if name.startswith(prefix):
            return lhs.astype(dtype), rhs.astype(dtype)
    if lhs.dtype != rhs.dtype:
        wide = jnp.promote_types(lhs.dtype, rhs.dtype)
        return lhs.astype(wide), rhs.astype(wide)
    return lhs, rhs


def _dot_general(eqn, lhs, rhs, unsupported=None):
    if not (is_float(lhs.dtype) or is_float(rhs.dtype)):
        return _bind(eqn, [lhs, rhs])
    from jaxdet._src.matmul import dot_general as dg

    p = eqn.params
    lhs, rhs = _operands_as_computed(lhs, rhs, p.get("precision"))
    try:
        return dg.dot_general(lhs, rhs, p["dimension_numbers"], p.get("preferred_element_type"))
    except TypeError as e:
        raise unsupported(eqn, str(e)) from None


# ---- Scatter-add: the canonical segment sum ----


def _windows_per_group(indices, dn):
    """How many windows each operand batch group receives (the index dims but the index vector
    dim, and but the batching dims)."""
    batch = set(dn.scatter_indices_batching_dims)
    return math.prod(n for d, n in enumerate(indices.shape[:-1]) if d not in batch)


def _scatter_add(eqn, operand, indices, updates, unsupported=None):
    total = _scatter_add_total(eqn, operand, indices, updates) if is_float(operand.dtype) else None
    if total is None:
        # Not floating point, or one window per group: each destination element receives at most
        # one update, so the result is one add per element, in no order.
        return _bind(eqn, [operand, indices, updates])
    return operand + total.astype(operand.dtype)


def _scatter_add_total(eqn, operand, indices, updates, out_dtype=None):
    """The sum of the updates per destination element by the canonical segment sum (None: one
    window per group, nothing summed)."""
    dn = eqn.params["dimension_numbers"]
    if _windows_per_group(indices, dn) <= 1:
        return None
    from jaxdet._src.embed import embed as segments

    mode = eqn.params["mode"]
    drop = mode is None or "FILL_OR_DROP" in str(mode)
    rows = _row_scatter(operand, indices, updates, dn)
    if rows is not None:
        ids, data = rows
        V = operand.shape[0]
        if not drop:
            ids = jnp.clip(ids, 0, V - 1)
        total = segments.segment_sum(data, ids, V, preferred_element_type=out_dtype)
    else:
        # Any other layout: each update element's destination (the same gather on an iota of the
        # operand) as one segment of its own.
        dest = _destinations(operand, indices, updates, dn, drop)
        total = segments.segment_sum(
            updates.reshape(-1, 1), dest.reshape(-1), operand.size, preferred_element_type=out_dtype
        )
    return total.reshape(operand.shape)


def _row_scatter(operand, indices, updates, dn):
    """(ids [T], data [T, D]) when the scatter adds whole rows of the operand (an embedding's
    gradient), else None."""
    W = operand.ndim - 1
    if (
        tuple(dn.inserted_window_dims) != (0,)
        or tuple(dn.scatter_dims_to_operand_dims) != (0,)
        or dn.operand_batching_dims
        or dn.scatter_indices_batching_dims
        or indices.shape[-1] != 1
        or tuple(dn.update_window_dims) != tuple(range(updates.ndim - W, updates.ndim))
        or tuple(updates.shape[updates.ndim - W :]) != tuple(operand.shape[1:])
    ):
        return None
    T = math.prod(indices.shape[:-1])
    return indices.reshape(T), updates.reshape(T, math.prod(operand.shape[1:]))


def _destinations(operand, indices, updates, dn, drop):
    window = iter(updates.shape[d] for d in dn.update_window_dims)
    collapsed = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    slice_sizes = tuple(1 if d in collapsed else next(window) for d in range(operand.ndim))
    gdn = lax.GatherDimensionNumbers(
        offset_dims=tuple(dn.update_window_dims),
        collapsed_slice_dims=tuple(dn.inserted_window_dims),
        start_index_map=tuple(dn.scatter_dims_to_operand_dims),
        operand_batching_dims=tuple(dn.operand_batching_dims),
        start_indices_batching_dims=tuple(dn.scatter_indices_batching_dims),
    )
    iota = lax.iota(jnp.int32, operand.size).reshape(operand.shape)
    mode = lax.GatherScatterMode.FILL_OR_DROP if drop else lax.GatherScatterMode.CLIP
    return lax.gather(iota, indices, gdn, slice_sizes, mode=mode, fill_value=-1)


# ---- Collectives: the canonical tree over the devices ----


def _collective_axes(eqn, unsupported):
    p = eqn.params
    if p.get("axis_index_groups") is not None:
        raise unsupported(eqn, "with axis_index_groups has no canonical tree")
    axes = p.get("axes", p.get("axis_name"))
    axes = tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)
    if not all(isinstance(a, str) for a in axes):
        raise unsupported(eqn, "over positional (pmap) axes has no canonical tree; use jax.shard_map")
    return axes


def _tree_psum(x, axes):
    acc = jnp.float32 if np.dtype(x.dtype).itemsize < 4 else x.dtype
    return tree.tree_psum(x.astype(acc), axes).astype(x.dtype)


def _psum(eqn, *xs, unsupported=None):
    if not any(is_float(x.dtype) for x in xs):
        return _bind(eqn, list(xs))
    outs = [_psum_one(eqn, x, unsupported) for x in xs]
    return outs if eqn.primitive.multiple_results else outs[0]


def _psum_one(eqn, x, unsupported):
    axes = _collective_axes(eqn, unsupported)
    if not is_float(x.dtype):
        return lax.psum(x, axes)
    try:
        return _tree_psum(x, axes)
    except ValueError as e:  # a device count that is not a power of two
        raise unsupported(eqn, str(e)) from None


def _reduce_scatter(eqn, x, unsupported=None):
    if not is_float(x.dtype):
        return _bind(eqn, [x])
    p = eqn.params
    axes = _collective_axes(eqn, unsupported)
    dim, tiled = p["scatter_dimension"], p.get("tiled", False)
    total = _tree_psum(x, axes)
    size = math.prod(lax.axis_size(a) for a in axes)
    idx = lax.axis_index(axes if len(axes) > 1 else axes[0])
    piece = x.shape[dim] // size
    out = lax.dynamic_slice_in_dim(total, idx * piece, piece, axis=dim)
    return out if tiled else jnp.squeeze(out, dim)


# Refused on floating-point operands (exact, and bound as they are, on integers).
FLOAT_REFUSED = {
    "reduce_prod": "is a floating-point product in XLA's order (no canonical rule)",
    "cumsum": "is a floating-point prefix sum in XLA's order (no canonical rule)",
    "cumprod": "is a floating-point prefix product in XLA's order (no canonical rule)",
    "cumlogsumexp": "is a floating-point prefix reduction in XLA's order (no canonical rule)",
    "scatter-mul": "is a floating-point scatter-multiply in XLA's order",
    "scatter_mul": "is a floating-point scatter-multiply in XLA's order",
}

# ---- Partial sums that a collective continues: rounded once, after the tree ----

# A half-precision value summed over devices (a replicated parameter's gradient, psum'd) is a sum
# over chunks of tokens whose tree continues over the devices: rounding each device's partial to
# half precision first would make the bits depend on the device count. So the products, sums and
# adds whose value a collective sums keep their float32 value beside the rounded one, and the
# collective sums those (then rounds once).
COLLECTIVE_SUMS = frozenset({"psum", "psum_invariant", "reduce_scatter"})
CARRIES_PARTIALS = frozenset({"add", "add_any", "convert_element_type"})
MOVES_PARTIALS = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "copy", "copy_p"})


def _wide(x, partial):
    return partial if partial is not None else jnp.asarray(x).astype(jnp.float32)


SUMS = frozenset({"dot_general", "reduce_sum", "scatter-add", "scatter_add"})


def unrounded(eqn, invals, partials):
    """The float32 value of `eqn`'s result before its rounding, or None where it has none.

    A partial sum is born in a product, sum or scatter-add by the rule (its float32 result before
    the cast to half precision; a float32 result is its own, see the interpreter) and carried by
    adds of partials, conversions of partials and data movement. A value that is not such a sum
    (data the function casts and sums over devices) has none: its rounding is the function's."""
    name = eqn.primitive.name
    out = eqn.outvars[0].aval
    if len(eqn.outvars) != 1 or not is_float(out.dtype):
        return None
    half = np.dtype(out.dtype).itemsize < 4
    if name == "dot_general" and half and all(is_float(x.dtype) for x in invals):
        from jaxdet._src.matmul import dot_general as dg

        lhs, rhs = _operands_as_computed(*invals, eqn.params.get("precision"))
        return dg.dot_general(lhs, rhs, eqn.params["dimension_numbers"], jnp.float32)
    if name == "reduce_sum" and half:
        from jaxdet._src.reduce import reduce as canonical

        return canonical.reduce_sum(invals[0], tuple(eqn.params["axes"]), np.dtype(np.float32))
    if name in ("scatter-add", "scatter_add") and half:
        operand, indices, updates = invals
        total = _scatter_add_total(eqn, operand, indices, updates, jnp.float32)
        if total is None:
            return None
        return _wide(operand, partials[0]) + _rounded(total)
    if all(p is None for p in partials):
        return None
    if name in ("add", "add_any"):
        a, b = (_rounded(_wide(x, part)) for x, part in zip(invals, partials))
        return a + b
    if name == "convert_element_type":
        return partials[0]
    if name in MOVES_PARTIALS:
        return eqn.primitive.bind(partials[0], *invals[1:], **eqn.params)
    return None


RULES = {
    "add": _add,
    "sub": _add,
    "add_any": _add,
    "div": _div,
    "reduce_sum": lambda eqn, x, unsupported=None: _reduce_sum(eqn, x),
    "reduce_max": _reduce_extreme(True),
    "reduce_min": _reduce_extreme(False),
    "cummax": _cumulative_extreme(True),
    "cummin": _cumulative_extreme(False),
    "dot_general": _dot_general,
    "scatter-add": _scatter_add,
    "scatter_add": _scatter_add,
    "scatter": lambda eqn, *a, unsupported=None: _bind(eqn, list(a)),
    "psum": _psum,
    "psum_invariant": _psum,
    "pmax": _collective_extreme(True),
    "pmin": _collective_extreme(False),
    "reduce_scatter": _reduce_scatter,
}
RULES.update({name: _refuse_float(why) for name, why in FLOAT_REFUSED.items()})


def covers(primitive_name: str) -> bool:
    """Whether `jaxdet.invariant` computes floating-point `primitive_name` by a canonical rule
    (or it is exact as it is), i.e. would not refuse it."""
    return primitive_name in EXACT or (primitive_name in RULES and primitive_name not in FLOAT_REFUSED)


def apply(eqn, invals, unsupported):
    name = eqn.primitive.name
    if name in EXACT or is_jaxdet(eqn):
        return _bind(eqn, invals)
    rule = RULES.get(name)
    if rule is not None:
        return rule(eqn, *invals, unsupported=unsupported)
    if name in REFUSED:
        raise unsupported(eqn, REFUSED[name])
    raise unsupported(eqn, "is not an operation jaxdet.invariant knows")


__all__ = [
    "CARRIES_PARTIALS",
    "COLLECTIVE_SUMS",
    "MOVES_PARTIALS",
    "EXACT",
    "FLOAT_REFUSED",
    "REFUSED",
    "RULES",
    "apply",
    "covers",
    "unrounded",
]
