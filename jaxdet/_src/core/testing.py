"""Bit-level comparison for jaxdet's contracts and for users' own tests.

Determinism is checked on raw bits, never with ``allclose``: two results are equal here only when
every element has the same bit pattern (so ``-0.0 != +0.0`` and NaN payloads count).

``assert_batch_invariant`` and ``assert_deterministic`` are how users test their own models
(docs/testing.md, proven by tests/test_testing.py).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "bits",
    "count_bit_differences",
    "same_bits",
    "assert_bitwise_equal",
    "describe_bit_differences",
    "assert_batch_invariant",
    "assert_deterministic",
]

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _is_tree(x) -> bool:
    """Whether `x` is a pytree to compare leaf by leaf: a container (dict, list, tuple, dataclass...)
    whose leaves are not all Python/NumPy scalars (``[1.0, 2.0]`` stays one array, as NumPy reads it)."""
    if isinstance(x, np.ndarray) or not isinstance(x, (dict, list, tuple)) and hasattr(x, "__array__"):
        return False
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(x)
    if jax.tree_util.treedef_is_leaf(treedef):
        return False
    return not leaves or not all(isinstance(leaf, (int, float, complex, bool, np.generic)) for leaf in leaves)


def _as_array(x, name="x") -> np.ndarray:
    a = np.asarray(x)
    if a.dtype == object:
        raise TypeError(
            f"{name} must be an array (or, where a function takes pytrees, a pytree of arrays), got {type(x).__name__}"
        )
    return a


def _tree_pairs(x, y, what):
    """[(name, leaf_x, leaf_y)] for two pytrees of the same structure; ValueError naming both
    structures otherwise."""
    import jax

    px, tx = jax.tree_util.tree_flatten_with_path(x)
    py, ty = jax.tree_util.tree_flatten_with_path(y)
    if tx != ty:
        raise ValueError(f"{what}: cannot compare pytrees of different structures: {tx} vs {ty}")
    return [(what + jax.tree_util.keystr(path), a, b) for (path, a), (_, b) in zip(px, py)]


def bits(x) -> np.ndarray:
    """The raw bits of an array as unsigned integers of the same width (uint16 for bfloat16).

    One array only; for a pytree use ``jax.tree.map(jaxdet.testing.bits, tree)``."""
    if _is_tree(x):
        raise TypeError(
            f"bits takes one array, got a pytree ({type(x).__name__}); use jax.tree.map(jaxdet.testing.bits, tree)"
        )
    a = _as_array(x)
    if a.dtype == np.bool_:
        return a.view(np.uint8)
    return a.view(_UINT_OF_SIZE[a.dtype.itemsize])


def count_bit_differences(x, y) -> int:
    """How many elements of two same-shape, same-dtype arrays differ in any bit (pytrees of the same
    structure: summed over the leaves)."""
    if _is_tree(x) or _is_tree(y):
        return sum(count_bit_differences(a, b) for _, a, b in _tree_pairs(x, y, "x"))
    a, b = _as_array(x), _as_array(y)
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare bits of {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    return int(np.count_nonzero(bits(a) != bits(b)))


def same_bits(x, y) -> bool:
    """True when both arrays (or pytrees of arrays, leaf by leaf) have the same dtype, shape and bits."""
    if _is_tree(x) or _is_tree(y):
        try:
            pairs = _tree_pairs(x, y, "x")
        except ValueError:
            return False
        return all(same_bits(a, b) for _, a, b in pairs)
    a, b = _as_array(x), _as_array(y)
    return a.dtype == b.dtype and a.shape == b.shape and count_bit_differences(a, b) == 0


def _is_float(dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or "float" in dtype.name  # bfloat16 & co. are ml_dtypes


def _ulps(ba: int, bb: int, width: int) -> int | None:
    # Distance in units in the last place between two floats of the same sign (bit patterns are
    # ordered like the magnitudes); None across signs.
    sign = 1 << (8 * width - 1)
    if (ba & sign) != (bb & sign):
        return None
    return abs(ba - bb)


def describe_bit_differences(x, y, what: str = "arrays", limit: int = 5) -> str | None:
    """None when ``x`` and ``y`` are bit-identical; otherwise a message with how many elements
    differ, where (the first ``limit`` indices), both values with their bits, and, for floats, the
    distance in ulps and the largest absolute difference.

    Pytrees of arrays are compared leaf by leaf: one line per differing leaf, named by its path
    (``what['params']['w']``), or a message naming both structures when they differ."""
    if _is_tree(x) or _is_tree(y):
        try:
            pairs = _tree_pairs(x, y, what)
        except ValueError as e:
            return str(e)
        msgs = [m for name, a, b in pairs if (m := describe_bit_differences(a, b, name, limit)) is not None]
        if not msgs:
            return None
        return f"{what}: {len(msgs)} of {len(pairs)} leaves differ\n" + "\n".join(msgs)
    a, b = _as_array(x), _as_array(y)
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{what}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    ba, bb = bits(a), bits(b)
    diff = ba != bb
    n = int(np.count_nonzero(diff))
    if not n:
        return None
    width = a.dtype.itemsize
    is_float = _is_float(a.dtype)
    idxs = [tuple(int(i) for i in idx) for idx in np.argwhere(diff)[:limit]] if a.ndim else [()]
    shown = []
    for idx in idxs:
        u, v = int(ba[idx]), int(bb[idx])
        ulp = _ulps(u, v, width) if is_float else None
        shown.append(
            f"{idx}: {a[idx]!s} (0x{u:0{2 * width}x}) vs {b[idx]!s} (0x{v:0{2 * width}x})"
            + (f" [{ulp} ulp]" if ulp is not None else "")
        )
    msg = f"{what}: {n} of {a.size} elements differ bitwise; first: {', '.join(shown)}"
    if is_float:
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.abs(a.astype(np.float64) - b.astype(np.float64))
        d = np.where(diff, d, 0.0)
        if np.isfinite(d).all():
            at = tuple(int(i) for i in np.unravel_index(int(np.argmax(d)), d.shape)) if a.ndim else ()
            msg += f"; largest |difference| {float(d[at]):.3g} at {at}"
    return msg


def assert_bitwise_equal(x, y, what: str = "arrays") -> None:
    """Raise AssertionError, with where and how the bits differ, unless `x` and `y` (arrays, or
    pytrees of arrays compared leaf by leaf) are bit-identical."""
    msg = describe_bit_differences(x, y, what)
    if msg is not None:
        raise AssertionError(msg)


# ---- Users' model tests. ----


def _key_bits(leaf):
    """A jax.random key array as its bits (nnx.Rngs state holds them), anything else as it is."""
    import jax

    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_data(leaf)
    return leaf


def _leaves_with_paths(tree, root="output"):
    import jax

    return [(root + jax.tree_util.keystr(path), leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def _nnx_rebind(fn):
    """For a function that reaches Flax nnx objects directly -- an nnx Module itself, a bound method
    of one, or a function whose closure cells or global names hold one -- ``(call, nodes)``:
    ``call(nodes, *args, **kwargs)`` runs ``fn`` with those objects replaced by ``nodes`` (so that
    ``nnx.jit`` can pass them as arguments and carry their state in and out); None otherwise.

    ``jax.jit`` of a closure over an nnx Module bakes its arrays in as constants and fails when the
    module mutates its state (an ``nnx.Rngs`` counter, batch statistics): nnx allows that only to
    objects passed through ``nnx.jit``'s arguments."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None:  # nnx objects exist only once flax.nnx is imported
        return None
    is_node = nnx.graph.is_graph_node
    if is_node(fn):
        return (lambda nodes, *a, **k: nodes[0](*a, **k)), [fn]
    if isinstance(fn, types.MethodType) and is_node(fn.__self__):
        func = fn.__func__
        return (lambda nodes, *a, **k: func(nodes[0], *a, **k)), [fn.__self__]
    if not isinstance(fn, types.FunctionType):
        return None
    cells = tuple(fn.__closure__ or ())

    def cell_node(cell):
        try:
            return is_node(cell.cell_contents)
        except ValueError:  # an empty cell
            return False

    cell_idx = [i for i, c in enumerate(cells) if cell_node(c)]
    glob_names = [n for n in fn.__code__.co_names if n in fn.__globals__ and is_node(fn.__globals__[n])]
    if not cell_idx and not glob_names:
        return None
    nodes = [cells[i].cell_contents for i in cell_idx] + [fn.__globals__[n] for n in glob_names]

    def call(nodes, *a, **k):
        new_cells = list(cells)
        for j, i in enumerate(cell_idx):
            new_cells[i] = types.CellType(nodes[j])
        g = fn.__globals__
        if glob_names:
            g = dict(g)
            g.update(zip(glob_names, nodes[len(cell_idx) :]))
        f = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, tuple(new_cells))
        f.__kwdefaults__ = fn.__kwdefaults__
        return f(*a, **k)

    return call, nodes


def _wrap_nnx_errors(nnx, inner, restore):
    def run(*a, **k):
        try:
            return inner(*a, **k)
        except sys.modules["flax.errors"].TraceContextError as e:
            raise TypeError(
                "the function under test mutates Flax nnx state that jaxdet.testing cannot pass through "
                "nnx.jit: it finds nnx objects only as the function itself, a bound method, the "
                "function's closure variables or global names, and the arguments; pass the module as "
                "an argument (fn(model, batch)) or use jit=False"
            ) from e
        finally:
            restore()

    return run


def _runner(fn, jit: bool, args=(), kwargs=None):
    """``fn`` as the helpers run it: ``jax.jit(fn)`` (or ``fn`` itself with jit=False).

    With Flax nnx objects (reached by ``fn`` as ``_nnx_rebind`` finds them, or passed in ``args`` /
    ``kwargs``), ``nnx.jit`` of ``fn`` taking them as arguments, and every call starts from the
    state they had when the helper was called and leaves them in it: a module that advances an
    ``nnx.Rngs`` counter is compared with itself, not with its next draw, and the helper does not
    change the model. ``make()`` gives a fresh runner (a new trace and compile)."""
    import jax

    nnx = sys.modules.get("flax.nnx")
    rebound = _nnx_rebind(fn)
    held = [] if rebound is None else list(rebound[1])
    if nnx is not None:
        held += [x for x in (*args, *(kwargs or {}).values()) if nnx.graph.is_graph_node(x)]
    if not held:

        def make_plain(with_state=False):
            f = jax.jit(lambda *a, **k: fn(*a, **k)) if jit else fn
            if with_state:
                f = (lambda g: lambda *a, **k: (g(*a, **k), []))(f)
            return f if nnx is None else _wrap_nnx_errors(nnx, f, lambda: None)

        return make_plain
    snapshot = [jax.tree.map(lambda v: v, nnx.state(node)) for node in held]

    def restore():
        for node, state in zip(held, snapshot):
            nnx.update(node, state)

    if rebound is None:
        call, nodes = (lambda nodes, *a, **k: fn(*a, **k)), []
    else:
        call, nodes = rebound

    def make(with_state=False):
        """with_state: the runner returns (fn's result, the objects' state after the call), so that
        what a step changes in place (an optimizer updating the model) is compared too."""
        inner = nnx.jit(call) if jit else call

        def run(*a, **k):
            out = inner(nodes, *a, **k)
            if not with_state:
                return out
            return out, [jax.tree.map(lambda v: v, nnx.state(node)) for node in held]

        return _wrap_nnx_errors(nnx, run, restore)

    return make


def _check_sizes(sizes, name):
    if isinstance(sizes, int) or not isinstance(sizes, Sequence) or not sizes:
        raise TypeError(f"{name} must be a non-empty sequence of ints, got {sizes!r}")
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1:
            raise ValueError(f"{name} must hold positive ints, got {sizes!r}")
    return tuple(int(s) for s in sizes)


def assert_batch_invariant(
    fn: Callable,
    batch,
    sizes: Sequence[int] = (1, 4, 16, 64),
    positions=None,
    *,
    row: int = 0,
    jit: bool = True,
    what: str | None = None,
) -> None:
    """Assert that a row's outputs have the same bits alone and inside batches of other sizes and
    at other positions.

    A *row* is an index of the leading axis: of every leaf of ``batch`` (all leaves share it) and of
    every leaf of ``fn``'s output (each output leaf must have that leading axis; reduce over the
    batch outside ``fn``). Row ``row`` of ``batch`` is run alone (a batch of 1), then placed at each
    position of batches of each size in ``sizes``, the other rows filled with ``batch``'s other rows
    in order (cycled when ``batch`` has fewer rows than the size); each time its output rows must
    equal the alone outputs bit for bit, for every output leaf.

    Args:
      fn: a function of one pytree ``batch`` (close over parameters: ``lambda b: model(params, b)``).
      batch: a pytree of arrays with a common leading (row) axis, at least one row.
      sizes: batch sizes to try.
      positions: where to place the row: None for the first, middle and last position of every
        size; or a sequence of ints (negative counts from the end; positions beyond a size skip it).
      row: which row of ``batch`` to follow.
      jit: run ``jax.jit(fn)`` (how models run); False calls ``fn`` as it is.
      what: a name for the failure message (default: ``fn``'s name).

    Raises AssertionError listing every (size, position) whose bits differ, with the first
    difference's element count, indices, values, bits and ulps; ValueError for a batch or outputs
    without a common leading axis.
    """
    import jax
    import jax.numpy as jnp

    sizes = _check_sizes(sizes, "sizes")
    if positions is not None:
        positions = _check_positions(positions)
    leaves = jax.tree.leaves(batch)
    if not leaves or any(np.ndim(x) == 0 for x in leaves):
        raise ValueError("batch must be a pytree of arrays that all have a leading (row) axis")
    n_rows = {int(np.shape(x)[0]) for x in leaves}
    if len(n_rows) != 1 or 0 in n_rows:
        raise ValueError(f"batch's leaves must share a non-empty leading axis, got leading sizes {sorted(n_rows)}")
    (n_rows,) = n_rows
    if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not -n_rows <= row < n_rows:
        raise ValueError(f"row must index batch's {n_rows} rows, got {row!r}")
    row = int(row) % n_rows
    name = what or getattr(fn, "__name__", "fn")
    run = _runner(fn, jit)()

    def take(idx):
        # Rows are copied by indexing (exact): NumPy leaves on the host, JAX arrays (typed PRNG
        # keys too) where they live.
        idx = np.asarray(idx, np.int32)
        return jax.tree.map(lambda x: x[jnp.asarray(idx)] if isinstance(x, jax.Array) else jnp.asarray(x[idx]), batch)

    def rows_of(out, n):
        named = _leaves_with_paths(out)
        for path, leaf in named:
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] != n:
                raise ValueError(
                    f"{name}: {path} has shape {list(np.shape(leaf))}, but a batch of {n} rows needs "
                    f"outputs with a leading axis of {n} (one row per input row): return per-row values and "
                    "reduce over the batch outside the function under test"
                )
        return named

    alone = rows_of(run(take([row])), 1)
    others = [i for i in range(n_rows) if i != row] or [row]
    failures = []
    for size in sizes:
        wanted = (0, size // 2, size - 1) if positions is None else positions
        places = sorted({p % size for p in wanted if -size <= p < size})
        for pos in places:
            fill = [others[k % len(others)] for k in range(size - 1)]
            idx = fill[:pos] + [row] + fill[pos:]
            got = rows_of(run(take(idx)), size)
            for (path, ref), (_, leaf) in zip(alone, got):
                msg = describe_bit_differences(
                    np.asarray(leaf)[pos],
                    np.asarray(ref)[0],
                    f"{name}: {path}, row {row} at position {pos} of a batch of {size} vs alone",
                )
                if msg is not None:
                    failures.append((size, pos, path, msg))
    if failures:
        summary = ", ".join(f"size {s} position {p} {path}" for s, p, path, _ in failures)
        raise AssertionError(
            f"{name} is not batch invariant: row {row}'s outputs changed in {len(failures)} case(s) ({summary}).\n"
            f"First: {failures[0][3]}"
        )


def _check_positions(positions):
    if isinstance(positions, int) or not isinstance(positions, Sequence) or not positions:
        raise TypeError(f"positions must be None or a non-empty sequence of ints, got {positions!r}")
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise TypeError(f"positions must hold ints, got {positions!r}")
    return tuple(int(p) for p in positions)


def assert_deterministic(
    fn: Callable, *args, runs: int = 3, recompile: bool = False, what: str | None = None, **kwargs
) -> None:
    """Assert that ``jax.jit(fn)(*args, **kwargs)`` gives the same bits in ``runs`` runs.

    Every output leaf of every run is compared bit for bit with the first run's, and so is the state
    of the Flax nnx objects ``fn`` reaches after each run (what an in-place step changes). ``recompile=True``
    traces and compiles a fresh program for every run (a new jit of a new wrapper), so choices XLA
    makes at compile time (GPU autotuning) are compared too; otherwise the runs reuse one
    executable and compare its execution only.

    Raises AssertionError naming the run and output leaf that differ, with the element count,
    indices, values, bits and ulps of the differences.
    """
    import jax

    if isinstance(runs, bool) or not isinstance(runs, (int, np.integer)) or runs < 2:
        raise ValueError(f"runs must be an int >= 2, got {runs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    name = what or getattr(fn, "__name__", "fn")
    make = _runner(fn, True, args, kwargs)
    # The Flax nnx objects' state after the call is compared too: an in-place step (the optimizer
    # updates the model, only the loss is returned) is checked whole.
    compiled = make(with_state=True)

    def once():
        f = make(with_state=True) if recompile else compiled
        out, states = jax.block_until_ready(f(*args, **kwargs))
        leaves = _leaves_with_paths(out) + _leaves_with_paths(states, "nnx state")
        return [(p, np.asarray(_key_bits(leaf))) for p, leaf in leaves]

    first = once()
    failures = []
    for r in range(1, int(runs)):
        for (path, ref), (_, leaf) in zip(first, once()):
            msg = describe_bit_differences(leaf, ref, f"{name}: {path}, run {r + 1} vs run 1")
            if msg is not None:
                failures.append(msg)
    if failures:
        raise AssertionError(
            f"{name} is not deterministic over {runs} runs"
            f"{' (recompiled each run)' if recompile else ''}: {len(failures)} output(s) "
            f"differ.\nFirst: {failures[0]}"
        )
