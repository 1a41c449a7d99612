"""Batch-invariant matrix multiplication with a deterministic, chunk-contracted weight gradient.

The contracts (docs/matmul.md, proven by tests/test_matmul.py):

* The chunk rule, one for every product (forward, dA, dB). The contracted dimension is cut into
  chunks of ``GEMM_CHUNK`` elements; each output element folds its chunk in index order in float32
  from 0, and the chunk partials are combined by the canonical balanced binary tree (lower index
  first, padded to a power of two with absent leaves: ``jaxdet.parallel.tree_sum``'s tree), in
  float32, cast once (RNE). Up to one chunk this is a single ascending fold.
* Row invariance. The bits of an output row of ``matmul(a, b)`` depend only on that row of ``a``
  and on ``b``: not on M, the row's position, the other rows, padding, batch dims, vmap or jit
  (on the GPU the output tile may depend on M, never what a tile computes: docs/matmul_cuda.md,
  "M buckets"). The same holds for ``dA = dC . B^T`` in the backward pass (B is read transposed
  in place). Appending zeros to K changes no bit.
* dB. ``dB = A^T . dC`` reduces over tokens (the rows of ``a``, all batch dims folded in) by the
  same rule. Micro-batches of 2^j chunks (the last may be shorter) combined with ``tree_sum``
  reproduce the full-batch dB bitwise, and so do devices holding such blocks. Appending zero rows
  leaves dB unchanged.
* Derivatives. The products are bilinear: the tangent is a sum of linear maps whose transposes
  are the backward products (dA's and dB's kernels), which are differentiable again, so jvp,
  linearize, grad and their compositions work to any order; every product in a derivative is a
  jaxdet product (row invariance and the chunk contract hold in tangents too).
* Many devices (docs/sharding.md, tests/test_sharding.py). Under shard_map, a replicated weight's
  gradient is the canonical tree over the devices (never a psum); under sharded jit, rows, batch
  and columns run per device with no collective, K is never split, and split tokens of dB meet by
  the canonical tree.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxdet._src.core import autodiff, batching, checks, ffi, tree, varying
from jaxdet._src.core.checks import FLOAT_DTYPES, float_dtype_of

__all__ = ["matmul", "matmul_weight_grad", "GEMM_CHUNK", "WGRAD_CHUNK_TOKENS", "SUPPORTED_DTYPES"]

# Elements of the contracted dimension per chunk, for every product (forward, dA, dB; the same on
# CPU and GPU): the leaves of the canonical tree. Micro-batches (or devices) holding 2^j chunks of
# tokens each reproduce the full-batch dB bitwise (see matmul_weight_grad); on the GPU the chunks
# are the split-K units.
GEMM_CHUNK = 8192
# dB's name for the same constant (its chunks are chunks of tokens).
WGRAD_CHUNK_TOKENS = GEMM_CHUNK

SUPPORTED_DTYPES = FLOAT_DTYPES
_F32 = np.dtype(jnp.float32)


# ---- Primitive 1: jaxdet_gemm. a [L, M, K] (or [L, K, M] with transpose_a), b [Lb, K, N] (or
# [Lb, N, K] with transpose_b), Lb in {1, L}; out [L, M, N] of dtype out_dtype, by the chunk rule
# with chunks of `chunk` elements of K (GEMM_CHUNK on every public path). ----


def _gemm_dims(a_shape, b_shape, transpose_a, transpose_b):
    L = a_shape[0]
    M, K = (a_shape[2], a_shape[1]) if transpose_a else (a_shape[1], a_shape[2])
    N = b_shape[1] if transpose_b else b_shape[2]
    return L, M, K, N


def gemm_workspace_bytes(L, M, N, K, chunk):
    """Device bytes the CUDA kernels need for a chunked K: room for a float32 partial of every chunk
    of every output tile (tiles padded up to 128 x 256: the per-chunk launches' [n, L, M, N] and the
    one-launch kernels' pending subtrees both fit) and an int32 flag (or arrival counter) per chunk and 16 x 16 tile."""
    n = -(-K // chunk) if chunk > 0 else 0
    if n <= 1:
        return 0
    partials = n * L * (M + 127) * (N + 255) * 4
    flags = n * L * (-(-M // 16)) * (-(-N // 16)) * 4
    return partials + flags + 1024


# Chunk boundaries fall on the GPU kernels' K tiles (64 elements on Hopper, 32 on sm_80), so a chunk
# is a whole number of them and each chunk's partial is an ordinary product of its K range.
CHUNK_MULTIPLE = 64


def _check_chunk(chunk):
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk <= 0 or chunk % CHUNK_MULTIPLE != 0:
        raise ValueError(
            f"chunk must be a positive int multiple of {CHUNK_MULTIPLE} (elements of K per chunk), got {chunk!r}"
        )


def _gemm_abstract_eval(a, b, *, transpose_a, transpose_b, out_dtype, chunk):
    _check_chunk(chunk)
    L, M, _, N = _gemm_dims(a.shape, b.shape, transpose_a, transpose_b)
    return jax.core.ShapedArray((L, M, N), out_dtype)


def gemm_cpu_workspace_bytes(L, M, N, K, chunk):
    """Host bytes the CPU kernel needs for a chunked K: the binary counter's float32 partials
    ([L, M, N] each; after chunk c it holds popcount(c + 1) of them, plus the one being computed)."""
    n = -(-K // chunk) if chunk > 0 else 0  # (a bad chunk is the handler's error to report)
    if n <= 1:
        return 0
    return (n.bit_length() + 1) * L * M * N * 4


def _gemm_workspace(avals, *, transpose_a, transpose_b, out_dtype, chunk):
    a, b = avals
    L, M, K, N = _gemm_dims(a.shape, b.shape, transpose_a, transpose_b)
    return gemm_workspace_bytes(L, M, N, K, chunk)


def _gemm_cpu_workspace(avals, *, transpose_a, transpose_b, out_dtype, chunk):
    a, b = avals
    L, M, K, N = _gemm_dims(a.shape, b.shape, transpose_a, transpose_b)
    return gemm_cpu_workspace_bytes(L, M, N, K, chunk)


def _gemm_batch(args, dims, *, transpose_a, transpose_b, out_dtype, chunk):
    a, b = args
    a_dim, b_dim = dims
    params = dict(transpose_a=transpose_a, transpose_b=transpose_b, out_dtype=out_dtype, chunk=chunk)
    if batching.not_mapped(b_dim) and not transpose_a:
        # Shared b: the vmapped axis of a folds into M (rows are independent, so the bits of every
        # row are those of the per-example call).
        a = jnp.moveaxis(a, a_dim, 1)  # [L, B, M, K]
        L, B, M, K = a.shape
        out = gemm_p.bind(a.reshape(L, B * M, K), b, **params)
        return out.reshape(L, B, M, out.shape[-1]), 1
    # Otherwise the vmapped axis joins L: a batched GEMM.
    size = a.shape[a_dim] if not batching.not_mapped(a_dim) else b.shape[b_dim]
    a = jnp.broadcast_to(a, (size,) + a.shape) if batching.not_mapped(a_dim) else jnp.moveaxis(a, a_dim, 0)
    L = a.shape[1]
    if batching.not_mapped(b_dim):
        b = jnp.broadcast_to(b, (size, L) + b.shape[1:])  # b [Lb, ., .], Lb in {1, L}
    else:
        b = jnp.moveaxis(b, b_dim, 0)
        if b.shape[1] != L:  # Lb == 1 < L: give every (example, l) its own b
            b = jnp.broadcast_to(b, (size, L) + b.shape[2:])
    out = gemm_p.bind(a.reshape((size * L,) + a.shape[2:]), b.reshape((size * L,) + b.shape[2:]), **params)
    return out.reshape((size, L) + out.shape[1:]), 0


def _gemm_factors(params, shapes):
    # Rows (m), columns (n) and the batch (l) are split per device with no collective; the
    # contraction (k) is never split: that would need a psum, whose order depends on the device
    # count, so a K-sharded operand is all-gathered instead (docs/sharding.md).
    a, b = shapes
    lb = "l" if b[0] == a[0] else "lb"  # a shared b (Lb = 1) broadcasts over the batch
    a_factors = ("l", "k", "m") if params["transpose_a"] else ("l", "m", "k")
    b_factors = (lb, "n", "k") if params["transpose_b"] else (lb, "k", "n")
    return [a_factors, b_factors], [("l", "m", "n")]


gemm_p = ffi.define_primitive(
    "jaxdet_gemm",
    _gemm_abstract_eval,
    attributes=lambda transpose_a, transpose_b, out_dtype, chunk: dict(
        transpose_a=bool(transpose_a), transpose_b=bool(transpose_b), chunk=np.int64(chunk)
    ),
    batching_rule=_gemm_batch,
    partitioning=ffi.Partitioning(_gemm_factors, replicated=frozenset({"k"})),
    cuda_workspace=_gemm_workspace,
    cpu_workspace=_gemm_cpu_workspace,
)


# ---- Primitive 2: jaxdet_gemm_wgrad. acc f32 [L, K, N] (aliased to the result), a [L, T, K],
# dc [L, T, N]: for each chunk of chunk_tokens tokens in order, acc = acc + a[chunk]^T . dc[chunk]. ----


def _wgrad_abstract_eval(acc, a, dc, *, chunk_tokens):
    return jax.core.ShapedArray(acc.shape, acc.dtype)


def _fold_mapped_axis(args, dims):
    """Moves the vmapped axis of every operand to the front and folds it into L: [size * L, ...]."""
    size = next(x.shape[d] for x, d in zip(args, dims) if not batching.not_mapped(d))
    moved = [
        jnp.broadcast_to(x, (size,) + x.shape) if batching.not_mapped(d) else jnp.moveaxis(x, d, 0)
        for x, d in zip(args, dims)
    ]
    L = moved[0].shape[1]
    return size, L, [x.reshape((size * L,) + x.shape[2:]) for x in moved]


def _wgrad_batch(args, dims, *, chunk_tokens):
    size, L, flat = _fold_mapped_axis(args, dims)
    out = wgrad_p.bind(*flat, chunk_tokens=chunk_tokens)
    return out.reshape((size, L) + out.shape[1:]), 0


wgrad_p = ffi.define_primitive(
    "jaxdet_gemm_wgrad",
    _wgrad_abstract_eval,
    attributes=lambda chunk_tokens: dict(chunk_tokens=np.int64(chunk_tokens)),
    batching_rule=_wgrad_batch,
    operand_output_aliases={0: 0},
)


# ---- Primitive 3: jaxdet_gemm_wgrad_init. a [L, T, K], dc [L, T, N] -> (dB [L, K, N] of out_dtype,
# workspace f32): the same chunk sequence with no accumulator to start from: chunk 0's partial is
# written as it is (no zero fill, no accumulator read), every later chunk adds. A bfloat16/float16
# dB is the float32 result cast once (RNE); on the GPU the earlier chunks accumulate in the float32
# workspace and the last chunk's epilogue adds and casts, so no float32 dB is written and cast
# afterwards. The workspace is [L, K, N] only when a half dB spans several chunks, else [L, 0, 0]. ----


def wgrad_init_shapes(L, T, K, N, chunk_tokens, out_dtype):
    needs_workspace = np.dtype(out_dtype) != _F32 and T > chunk_tokens
    return (L, K, N), (L, K, N) if needs_workspace else (L, 0, 0)


def _wgrad_init_abstract_eval(a, dc, *, chunk_tokens, out_dtype):
    L, T, K = a.shape
    out_shape, ws_shape = wgrad_init_shapes(L, T, K, dc.shape[2], chunk_tokens, out_dtype)
    return (jax.core.ShapedArray(out_shape, out_dtype), jax.core.ShapedArray(ws_shape, jnp.float32))


def _wgrad_init_batch(args, dims, *, chunk_tokens, out_dtype):
    size, L, flat = _fold_mapped_axis(args, dims)
    outs = wgrad_init_p.bind(*flat, chunk_tokens=chunk_tokens, out_dtype=out_dtype)
    return [o.reshape((size, L) + o.shape[1:]) for o in outs], [0, 0]


wgrad_init_p = ffi.define_primitive(
    "jaxdet_gemm_wgrad_init",
    _wgrad_init_abstract_eval,
    attributes=lambda chunk_tokens, out_dtype: dict(chunk_tokens=np.int64(chunk_tokens)),
    batching_rule=_wgrad_init_batch,
    multiple_results=True,
)


# ---- The differentiable 3-D core: a3 [L, M, K] @ b3 [Lb, K, N], Lb in {1, L} (1 only when L == 1). ----

# bfloat16/float16 rows must be 16-byte aligned for the GPU kernels' TMA loads and stores, so K and
# N are zero-padded to multiples of 8 there. This is exact: padding K adds 0 * 0 products after the
# real ones (what TMA's out-of-bounds fill feeds the last K tile anyway), padding N adds output
# columns that are sliced off. It depends on (dtype, K, N) only, never on M.
_ALIGN = 8


def _padded(n, dtype):
    return -(-n // _ALIGN) * _ALIGN if np.dtype(dtype).itemsize == 2 else n


def _pad_last2(x, rows, cols):
    if x.shape[-2:] == (rows, cols):
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, rows - x.shape[-2]), (0, cols - x.shape[-1])])


def _gemm(a3, b3, out_dtype, transpose_b=False):
    """op(a3) @ op(b3): a3 [L, M, K]; b3 [Lb, K, N] (or [Lb, N, K] with transpose_b)."""
    M, K = a3.shape[-2:]
    N = b3.shape[-2] if transpose_b else b3.shape[-1]
    Kp, Np = _padded(K, a3.dtype), _padded(N, a3.dtype)
    a3 = _pad_last2(a3, M, Kp)
    b3 = _pad_last2(b3, Np, Kp) if transpose_b else _pad_last2(b3, Kp, Np)
    out = gemm_p.bind(
        a3, b3, transpose_a=False, transpose_b=transpose_b, out_dtype=np.dtype(out_dtype), chunk=GEMM_CHUNK
    )
    return out if Np == N else out[..., :N]


def _chunk_tree(a3, dc3):
    """The canonical tree of the float32 chunk partials of a3ᵀ . dc3, for more than 3 chunks.

    The kernels reduce a pair of chunks as p0 + p1 (the add fused in the second GEMM's epilogue);
    pairs are then merged by XLA adds in binary-counter order: the stack holds aligned subtrees
    of decreasing size, so at most log2(chunks) + 1 partials are live.
    """
    c = GEMM_CHUNK
    T = a3.shape[1]
    stack = []  # [(chunks in the subtree, float32 root)]
    for lo in range(0, T, 2 * c):
        if stack:
            # Everything before this pair is merged before its GEMM may start (XLA would otherwise
            # be free to run all pair GEMMs first, with one live partial per pair).
            roots, a3, dc3 = jax.lax.optimization_barrier(([v for _, v in stack], a3, dc3))
            stack = [(n, v) for (n, _), v in zip(stack, roots)]
        part, _ = wgrad_init_p.bind(a3[:, lo : lo + 2 * c], dc3[:, lo : lo + 2 * c], chunk_tokens=c, out_dtype=_F32)
        stack.append((min(2, -(-(T - lo) // c)), part))
        while len(stack) > 1 and stack[-1][0] == stack[-2][0]:
            (n, left), (_, right) = stack[-2:]
            stack[-2:] = [(2 * n, left + right)]
    # What is left are aligned subtrees of decreasing size; with absent padding they join right to
    # left (the smallest sits under the rightmost nodes).
    root = stack[-1][1]
    for _, left in reversed(stack[:-1]):
        root = left + root
    return root


def _wgrad(acc3, a3, dc3, out_dtype=_F32):
    """acc3 [L, K, N] + a3ᵀ [L, T, K] . dc3 [L, T, N]: chunk partials by the canonical tree, float32.

    acc3 None: the tree alone, cast once to `out_dtype` (float32 or the inputs' dtype); otherwise
    the float32 ``acc3 + tree`` (acc3 added once).
    """
    T, K = a3.shape[-2:]
    N = dc3.shape[-1]
    Kp, Np = _padded(K, a3.dtype), _padded(N, a3.dtype)
    a3, dc3 = _pad_last2(a3, T, Kp), _pad_last2(dc3, T, Np)
    chunks = -(-T // GEMM_CHUNK)
    if acc3 is not None and chunks <= 1:
        out = wgrad_p.bind(_pad_last2(acc3, Kp, Np), a3, dc3, chunk_tokens=GEMM_CHUNK)
    else:
        if chunks <= 3:
            # The tree of up to 3 leaves, (p0 + p1) + p2, is the kernel's own chunk sequence (a
            # half dB is cast in the last chunk's epilogue).
            tree_dtype = _F32 if acc3 is not None else np.dtype(out_dtype)
            out, _ = wgrad_init_p.bind(a3, dc3, chunk_tokens=GEMM_CHUNK, out_dtype=tree_dtype)
        else:
            out = _chunk_tree(a3, dc3)
            if acc3 is None:
                out = out.astype(out_dtype)
        if acc3 is not None:
            out = _pad_last2(acc3, Kp, Np) + out
    return out if (Kp, Np) == (K, N) else out[..., :K, :N]


# ---- Shared weights as one primitive (jaxdet_gemm_rows): a [*R, K] . b [K, N] (or bᵀ, b [N, K],
# read transposed in place) -> [*R, N]: every row of every leading dimension is one row of a single
# GEMM. The rows are flattened on each device's own shard, so a split of any leading dimension
# (the batch, the sequence, the rows) stays local; flattening before the primitive would make a
# split of an inner dimension non-contiguous and force the partitioner to move data. ----


def _rows_abstract_eval(a, b, *, transpose_b, out_dtype):
    return jax.core.ShapedArray(a.shape[:-1] + (b.shape[0] if transpose_b else b.shape[1],), out_dtype)


def _rows_batch(args, dims, *, transpose_b, out_dtype):
    a, b = args
    a_dim, b_dim = dims
    if batching.not_mapped(b_dim):  # the vmapped axis of a is one more leading dimension of rows
        return rows_gemm_p.bind(jnp.moveaxis(a, a_dim, 0), b, transpose_b=transpose_b, out_dtype=out_dtype), 0
    # A vmapped b: a batched GEMM, example s's rows against b[s].
    size = b.shape[b_dim]
    b = jnp.moveaxis(b, b_dim, 0)
    a = jnp.broadcast_to(a, (size,) + a.shape) if batching.not_mapped(a_dim) else jnp.moveaxis(a, a_dim, 0)
    out = _gemm(a.reshape(size, -1, a.shape[-1]), b, out_dtype, transpose_b=transpose_b)
    return out.reshape(a.shape[:-1] + (out.shape[-1],)), 0


def _rows_factors(params, shapes):
    a, _ = shapes
    rows = tuple(f"r{i}" for i in range(len(a) - 1))
    b_factors = ("n", "k") if params["transpose_b"] else ("k", "n")
    return [rows + ("k",), b_factors], [rows + ("n",)]


def _rows_local(params, axes, shapes):
    def run(a, b):
        out = _gemm(a.reshape(1, -1, a.shape[-1]), b[None], params["out_dtype"], transpose_b=params["transpose_b"])
        return out.reshape(a.shape[:-1] + (out.shape[-1],))

    return run


rows_gemm_p = ffi.define_composite(
    "jaxdet_gemm_rows",
    _rows_abstract_eval,
    ffi.Partitioning(_rows_factors, replicated=frozenset({"k"}), local=_rows_local),
    batching_rule=_rows_batch,
)


# ---- The weight gradient as one primitive (jaxdet_weight_grad): a3 [L, T, K], dc3 [L, T, N] ->
# a3ᵀ . dc3 [L, K, N] of out_dtype, by `_wgrad`'s chunk tree. It exists to carry a partitioning
# rule: with the tokens split over devices, each device reduces its own chunks and the devices'
# float32 partials are combined by the canonical tree (`tree_psum_untyped`), the top levels of the
# same tree, so the bits are those of the unsplit call when every device holds 2^j whole chunks
# (`tree.whole_chunk_split`). The other dimensions are split per device with no collective. ----


def _weight_grad_abstract_eval(a, dc, *, out_dtype):
    return jax.core.ShapedArray((a.shape[0], a.shape[2], dc.shape[2]), out_dtype)


def _weight_grad_batch(args, dims, *, out_dtype):
    size, L, flat = _fold_mapped_axis(args, dims)
    out = weight_grad_p.bind(*flat, out_dtype=out_dtype)
    return out.reshape((size, L) + out.shape[1:]), 0


def _weight_grad_factors(params, shapes):
    return [("l", "t", "k"), ("l", "t", "n")], [("l", "k", "n")]


def _weight_grad_local(params, axes, shapes):
    tokens = axes.get("t", ())
    out_dtype = params["out_dtype"]

    def run(a3, dc3):
        return tree.reduce_over_devices(lambda dt: _wgrad(None, a3, dc3, out_dtype=dt), tokens, out_dtype)

    return run


# A split of the reduced dimension only along whole subtrees of its chunk tree.
_TOKEN_SPLIT = tree.whole_chunk_split("t", GEMM_CHUNK)
weight_grad_p = ffi.define_composite(
    "jaxdet_weight_grad",
    _weight_grad_abstract_eval,
    ffi.Partitioning(_weight_grad_factors, reduced=frozenset({"t"}), local=_weight_grad_local, can_split=_TOKEN_SPLIT),
    batching_rule=_weight_grad_batch,
)


# ---- The differentiable 3-D products. Each is bilinear: its tangent is the sum of two linear maps
# (`autodiff.linear_call`), each the product with one operand's tangent, whose transposes are the
# backward products (dA's and dB's kernels). Those call these functions again, so derivatives of
# any order work, forward and reverse. ----


def _cotangent(compute, dtype, vma, others):
    return tree.cotangent(compute, dtype, vma, others)


def _bilinear_tangent(out, x, y, tx, ty, term_x, term_y):
    """The tangent of a bilinear product: ``term_x(x, y, tx) + term_y(x, y, ty)`` for the operands
    whose tangent is not a symbolic zero."""
    parts = []
    if not autodiff.is_zero(tx):
        parts.append(term_x(x, y, tx))
    if not autodiff.is_zero(ty):
        parts.append(term_y(x, y, ty))
    if not parts:
        return jnp.zeros_like(out)
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _product(x, y, out_dtype, transpose_b=False, rows=False):
    """x . op(y), op(y) = y or yᵀ (read transposed in place): the forward (nn) and dA's (nt) product.

    rows=False: x [L, M, K], y [Lb, K, N] (or [Lb, N, K]) -> [L, M, N] (`gemm_p`); rows=True: shared
    weights, x [*R, K], y [K, N] (or [N, K]) -> [*R, N] (`rows_gemm_p`). Each is the other's
    transpose, so the backward is made of the same function and higher derivatives work.
    """
    if rows:
        return rows_gemm_p.bind(x, y, transpose_b=transpose_b, out_dtype=np.dtype(out_dtype))
    return _gemm(x, y, out_dtype, transpose_b=transpose_b)


def _product_dx(x, out_dtype, transpose_b, rows):
    """The transpose in x of ``tx -> tx . op(y)``: ``g . op(y)ᵀ`` (dA's product)."""
    dtype, vma = x.dtype, varying.varying_axes(x)

    def transpose(y, g):
        # The cotangent enters the kernels in the input dtype (a float32 cotangent of a bf16/f16
        # matmul with preferred_element_type=float32 is rounded once to the input dtype).
        g = g.astype(dtype)
        return (_cotangent(lambda dt: _product(g, y, dt, not transpose_b, rows), dtype, vma, (g, y)),)

    return transpose


def _product_dy(y, out_dtype, transpose_b, rows):
    """The transpose in y of ``ty -> x . op(ty)``: the chunk-tree weight gradient, cast once:
    xᵀ.g, or gᵀ.x when op(y) = yᵀ; shared weights fold every row dimension into tokens."""
    dtype, vma = y.dtype, varying.varying_axes(y)

    def transpose(x, g):
        g = g.astype(x.dtype)
        lhs, rhs = (g, x) if transpose_b else (x, g)
        if rows:
            lhs, rhs = _tokens(lhs), _tokens(rhs)
        return (
            _cotangent(
                lambda dt: _weight_grad3(lhs, rhs, dt)[0] if rows else _weight_grad3(lhs, rhs, dt), dtype, vma, (x, g)
            ),
        )

    return transpose


def _product_jvp(out_dtype, transpose_b, rows, primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    out = _product(x, y, out_dtype, transpose_b, rows)

    def term_x(x, y, tx):
        fn = lambda y, tx: (_product(tx, y, out_dtype, transpose_b, rows),)  # noqa: E731
        return autodiff.linear_call(fn, _product_dx(x, out_dtype, transpose_b, rows), (y,), (tx,))[0]

    def term_y(x, y, ty):
        fn = lambda x, ty: (_product(x, ty, out_dtype, transpose_b, rows),)  # noqa: E731
        return autodiff.linear_call(fn, _product_dy(y, out_dtype, transpose_b, rows), (x,), (ty,))[0]

    return out, _bilinear_tangent(out, x, y, tx, ty, term_x, term_y)


_product.defjvp(_product_jvp, symbolic_zeros=True)


def _matmul3(a3, b3, out_dtype):
    return _product(a3, b3, out_dtype, False, False)


def _matmul3_nt(x3, y3, out_dtype):
    return _product(x3, y3, out_dtype, True, False)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _weight_grad3(a3, dc3, out_dtype):
    """a3ᵀ . dc3: a3 [L, T, K], dc3 [L, T, N] -> [L, K, N] (dB's product, `weight_grad_p`)."""
    return weight_grad_p.bind(a3, dc3, out_dtype=np.dtype(out_dtype))


def _weight_grad3_jvp(out_dtype, primals, tangents):
    (a3, dc3), (ta, tdc) = primals, tangents
    out = _weight_grad3(a3, dc3, out_dtype)

    def term_a(a3, dc3, ta):
        dtype, vma = a3.dtype, varying.varying_axes(a3)

        def transpose(dc3, g):
            g = g.astype(dtype)
            return (_cotangent(lambda dt: _matmul3_nt(dc3, g, dt), dtype, vma, (dc3, g)),)

        return autodiff.linear_call(lambda dc3, ta: (_weight_grad3(ta, dc3, out_dtype),), transpose, (dc3,), (ta,))[0]

    def term_dc(a3, dc3, tdc):
        dtype, vma = dc3.dtype, varying.varying_axes(dc3)

        def transpose(a3, g):
            g = g.astype(a3.dtype)
            return (_cotangent(lambda dt: _matmul3(a3, g, dt), dtype, vma, (a3, g)),)

        return autodiff.linear_call(lambda a3, tdc: (_weight_grad3(a3, tdc, out_dtype),), transpose, (a3,), (tdc,))[0]

    return out, _bilinear_tangent(out, a3, dc3, ta, tdc, term_a, term_dc)


_weight_grad3.defjvp(_weight_grad3_jvp, symbolic_zeros=True)


def _tokens(x):
    """x [*R, C] as [1, T, C]: every leading dimension folded into tokens, row-major."""
    return x.reshape(1, -1, x.shape[-1])


def _matmul_rows(a, b, out_dtype):
    """Shared weights: a [*R, K] . b [K, N] -> [*R, N]."""
    return _product(a, b, out_dtype, False, True)


# ---- Checks shared by the public functions. ----


def _check_same_dtype(a_dtype, b_dtype, names):
    if a_dtype != b_dtype:
        raise TypeError(
            f"{names[0]} and {names[1]} must have the same dtype, got {a_dtype.name} and {b_dtype.name}; "
            "cast one of them explicitly (jaxdet.matmul never promotes)"
        )


def matmul(a, b, *, preferred_element_type=None):
    """Batch-invariant ``a @ b``.

    Args:
      a: ``[..., M, K]`` float32, bfloat16 or float16.
      b: ``[K, N]`` (shared weights: a's batch dims fold into M) or ``[..., K, N]`` (batched,
        broadcast against a's batch dims as in ``jnp.matmul``). Same dtype as ``a``.
      preferred_element_type: None (output in the input dtype) or ``jnp.float32`` (float32 output
        for bf16/f16 inputs). Accumulation is always float32; float32 inputs use true float32
        arithmetic, never TF32.

    Returns ``[..., M, N]``. K is reduced by the chunk rule: float32 folds within chunks of
    ``GEMM_CHUNK`` elements, combined by the canonical tree, cast once. Row ``i`` of the result is
    bitwise a function of row ``i`` of ``a`` and of ``b`` only. Differentiable to any order, forward
    and reverse (docs/matmul.md, "Derivatives"): dA and the tangent have the same row invariance;
    dB follows the chunk contract of ``matmul_weight_grad``.
    Works inside ``jax.shard_map`` and under sharded ``jax.jit`` (docs/sharding.md).

    Raises TypeError for unsupported or mixed dtypes and a bad ``preferred_element_type``,
    ValueError for ranks below 2 and for mismatched K (naming both shapes).
    """
    a_dtype = float_dtype_of(a, "a")
    b_dtype = float_dtype_of(b, "b")
    _check_same_dtype(a_dtype, b_dtype, ("a", "b"))
    out_dtype = checks.accumulated_result_dtype(a_dtype, preferred_element_type, "preferred_element_type")
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    if len(a_shape) < 2 or len(b_shape) < 2:
        raise ValueError(
            f"a and b must have rank >= 2 (a[..., M, K], b[..., K, N]), got a{list(a_shape)} b{list(b_shape)}"
        )
    M, K = a_shape[-2:]
    Kb, N = b_shape[-2:]
    if K != Kb:
        raise ValueError(f"matmul contraction mismatch: a{list(a_shape)} has K={K} but b{list(b_shape)} has K={Kb}")
    try:
        batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    except ValueError:
        raise ValueError(f"batch dimensions of a{list(a_shape)} and b{list(b_shape)} do not broadcast") from None
    out_shape = batch + (M, N)
    a = jnp.asarray(a)
    b = jnp.asarray(b)
    if math.prod(out_shape) == 0 or K == 0:
        return tree.match_varying(jnp.zeros(out_shape, out_dtype), varying.varying_union(a, b))
    if all(d == 1 for d in b_shape[:-2]):
        # Shared weights: every row of every batch element is one row of a single GEMM.
        return _matmul_rows(jnp.broadcast_to(a, batch + (M, K)), b.reshape(K, N), out_dtype)
    L = math.prod(batch)
    a3 = jnp.broadcast_to(a, batch + (M, K)).reshape(L, M, K)
    b3 = jnp.broadcast_to(b, batch + (K, N)).reshape(L, K, N)
    return _matmul3(a3, b3, out_dtype).reshape(out_shape)


def matmul_weight_grad(a, dc, acc=None):
    """``acc + a^T . dc`` over all tokens, with dB's chunk tree: a float32 ``[K, N]``.

    Args:
      a: ``[..., K]`` activations (all leading dims are tokens, flattened row-major).
      dc: ``[..., N]`` output cotangents with the same leading dims, in a's dtype.
      acc: float32 ``[K, N]`` to add the result to (once), or None.

    The tokens are cut into chunks of ``GEMM_CHUNK`` (the last may be shorter); each chunk
    sums its tokens in ascending order in float32 from 0, and the chunk partials are combined by
    the canonical balanced binary tree (``jaxdet.parallel.tree_sum``'s: lower index first, padded
    to a power of two with absent leaves). Returns ``acc + tree`` (or the tree).

    This is exactly how ``jax.grad`` of ``matmul(x, w)`` computes dW (then cast to w's dtype). An
    aligned block of 2^j chunks is a subtree, so micro-batches of 2^j chunks each (the same j; the
    last micro-batch may be shorter) reproduce the full batch::

        parts = [matmul_weight_grad(x_i, dc_i) for x_i, dc_i in micro_batches]
        dw = jaxdet.parallel.tree_sum(parts).astype(w.dtype)   # bitwise jax.grad's dW of the whole batch

    Up to 3 chunks the tree is the left fold, so ``acc = matmul_weight_grad(x_i, dc_i, acc)`` over
    micro-batches of one chunk each gives the same bits too. Appending zero rows (padding tokens)
    to ``a`` and ``dc`` does not change the result.
    """
    a_dtype = float_dtype_of(a, "a")
    dc_dtype = float_dtype_of(dc, "dc")
    _check_same_dtype(a_dtype, dc_dtype, ("a", "dc"))
    a_shape, dc_shape = tuple(a.shape), tuple(dc.shape)
    if len(a_shape) < 1 or len(dc_shape) < 1 or a_shape[:-1] != dc_shape[:-1]:
        raise ValueError(
            f"a[..., K] and dc[..., N] must have the same token dims, got a{list(a_shape)} dc{list(dc_shape)}"
        )
    K, N = a_shape[-1], dc_shape[-1]
    if acc is not None:
        if not (hasattr(acc, "dtype") and hasattr(acc, "shape")) or np.dtype(acc.dtype) != _F32:
            raise TypeError(f"acc must be a float32 array, got {getattr(acc, 'dtype', type(acc).__name__)}")
        if tuple(acc.shape) != (K, N):
            raise ValueError(
                f"acc must have shape [K, N] = {[K, N]} for a{list(a_shape)} dc{list(dc_shape)}, got {list(acc.shape)}"
            )
        acc = jnp.asarray(acc)
    T = math.prod(a_shape[:-1])
    if T == 0 or K == 0 or N == 0:
        return jnp.zeros((K, N), jnp.float32) if acc is None else acc
    a3 = jnp.asarray(a).reshape(1, T, K)
    dc3 = jnp.asarray(dc).reshape(1, T, N)
    return _wgrad(None if acc is None else acc.reshape(1, K, N), a3, dc3).reshape(K, N)


# `jaxdet.matmul` is the function (the package exports it), so the chunk size is reachable from it too.
matmul.GEMM_CHUNK = GEMM_CHUNK
matmul.WGRAD_CHUNK_TOKENS = WGRAD_CHUNK_TOKENS
matmul.SUPPORTED_DTYPES = SUPPORTED_DTYPES
