"""``jaxdet.audit``: the operations of a JAX function that can break bitwise reproducibility.

``audit(fn, *example_args)`` traces ``fn`` to a jaxpr (the program ``jax.jit(fn)`` compiles),
walks every equation, nested ones included (jit, custom_jvp/custom_vjp, scan/while/cond bodies,
shard_map, remat), and reports each operation that can change a row's bits with the batch, change
bits from run to run, or change a cross-device/cross-row sum with the device count on the audited
backend: with its shapes, its source line, why, and the jaxdet op or XLA flag that fixes it.
The rules and what each finding means are in docs/audit.md (proven by tests/test_audit.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np

from jaxdet._src.audit.rules import (
    BATCH,
    DEVICES,
    RUN,
    avals_str,
    classify,
    eqn_axes,
    opaque,
    same_structure,
)
from jaxdet._src.core import graph_state
from jaxdet._src.core.jaxprs import is_literal, sub_jaxprs
from jaxdet._src.invariant import rules as invariant_rules

__all__ = ["audit", "AuditReport", "Finding", "BATCH", "RUN", "DEVICES"]

_INVARIANT_FIX = (
    "; or the whole function through jaxdet.invariant(fn), which computes this operation by its "
    "canonical rule (docs/invariant.md)"
)


def _with_invariant(fix: str, primitive: str) -> str:
    """Every finding on an operation jaxdet.invariant covers names it as a fix for the whole step."""
    return fix + _INVARIANT_FIX if invariant_rules.covers(primitive) else fix


# ---------------------------------------------------------------------------------------------
# Findings and the report.


@dataclasses.dataclass(frozen=True)
class Finding:
    """One operation of the audited program that can break an invariance on the audited backend.

    ``blocking`` findings make ``AuditReport.ok`` false; the others (``kind == "unverified"`` outside
    strict mode) are operations the audit cannot see into.
    """

    kind: str  # dot, conv, reduce, softmax-backward, cumulative, scatter, attention, collective, rng, ...
    primitive: str
    shapes: str  # "f32[16,256] x f32[256,128] -> f32[16,128]"
    file: str
    line: int
    function: str
    breaks: tuple[str, ...]
    why: str
    fix: str
    origin: str = ""  # the library function the user called, e.g. "jax.nn.log_softmax"
    backward: bool = False  # produced by differentiation (a transposed/linearized equation)
    path: str = ""  # the nesting of the equation: "jit(step) > scan > checkpoint"
    blocking: bool = True
    count: int = 1  # identical equations (same op, shapes, line and origin) reported once

    @property
    def location(self) -> str:
        return f"{self.file}:{self.line}" if self.line else self.file

    def __str__(self) -> str:
        where = f"{_short_path(self.file)}:{self.line}" if self.line else "<unknown source>"
        head = f"{self.primitive} {self.shapes}" + (f" (x{self.count})" if self.count > 1 else "")
        tags = [t for t in (f"via {self.origin}" if self.origin else "", "backward" if self.backward else "") if t]
        lines = [
            f"{head}",
            f"    at {where} in {self.function}" + (f" [{', '.join(tags)}]" if tags else ""),
            f"    breaks: {', '.join(self.breaks) or '-'}" + ("" if self.blocking else " (not blocking)"),
            f"    why: {self.why}",
            f"    fix: {self.fix}",
        ]
        if self.path:
            lines.insert(2, f"    inside: {self.path}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The findings of ``jaxdet.audit``; ``ok`` is true when none of them is blocking."""

    findings: tuple[Finding, ...]
    backend: str
    strict: bool
    ignored: tuple[Finding, ...] = ()
    batch_axes: bool = False  # whether batch axes were known (batch_argnums given and the doubled trace matched)

    @property
    def ok(self) -> bool:
        return not any(f.blocking for f in self.findings)

    @property
    def blocking(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.blocking)

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self):
        return iter(self.findings)

    def __str__(self) -> str:
        n_block = len(self.blocking)
        head = (
            f"jaxdet.audit ({self.backend}{', strict' if self.strict else ''}): "
            + ("OK, " if self.ok else "NOT OK, ")
            + f"{len(self.findings)} finding(s), {n_block} blocking"
            + (f", {len(self.ignored)} ignored" if self.ignored else "")
            + ("" if self.batch_axes else " (batch axes unknown: pass batch_argnums for a precise audit)")
        )
        if not self.findings:
            return head
        rows = [("#", "kind", "op", "source", "breaks")]
        for i, f in enumerate(self.findings, 1):
            src = f"{_short_path(f.file)}:{f.line}" if f.line else "?"
            rows.append(
                (
                    str(i),
                    f.kind,
                    f.primitive + (" (bwd)" if f.backward else ""),
                    src,
                    ",".join(f.breaks) + ("" if f.blocking else " (note)"),
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        table = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        details = [f"{i}. {f}" for i, f in enumerate(self.findings, 1)]
        return "\n".join([head, "", *table, "", *details])

    __repr__ = __str__


def _short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


# ---------------------------------------------------------------------------------------------
# Where an equation comes from: the user's source line and the library function called there.


def _package_roots() -> dict[str, str]:
    roots = {}
    for pkg in ("jax", "jaxlib", "flax", "optax", "numpy", "chex", "equinox", "haiku", "ml_dtypes", "jaxdet"):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            roots[os.path.realpath(loc) + os.sep] = pkg
    return roots


_ROOTS = _package_roots()
# Frames of these files only route calls (tracing, jit, module plumbing): never "the function called".
_PLUMBING = (
    "jax/_src/pjit.py",
    "jax/_src/api.py",
    "jax/_src/api_util.py",
    "jax/_src/traceback_util.py",
    "jax/_src/core.py",
    "jax/_src/linear_util.py",
    "jax/_src/source_info_util.py",
    "jax/_src/custom_derivatives.py",
    "jax/_src/ad_checkpoint.py",
    "jax/_src/dispatch.py",
    "jax/_src/profiler.py",
    "jax/_src/util.py",
    "jax/_src/interpreters/",
    "jax/_src/config.py",
    "jax/_src/tree_util.py",
    "jax/_src/numpy/util.py",
    "jax/_src/deprecations.py",
    "flax/linen/module.py",
    "flax/linen/transforms.py",
    "flax/core/",
    "flax/nnx/graph.py",
    "flax/nnx/object.py",
    "flax/nnx/module.py",
    "flax/nnx/transforms/",
    "flax/nnx/pytreelib.py",
    "flax/nnx/variablelib.py",
)
_PREFIXES = (
    ("jax/_src/nn/", "jax.nn."),
    ("jax/_src/numpy/", "jnp."),
    ("jax/_src/lax/", "lax."),
    ("jax/_src/random", "jax.random."),
    ("jax/_src/ops/", "jax.ops."),
    ("jax/_src/scipy/", "jax.scipy."),
    ("jax/_src/cudnn/", "jax.nn."),
    ("optax/", "optax."),
    ("flax/", "flax:"),
    ("jaxdet/", "jaxdet."),
)


def _library_path(file_name: str) -> str | None:
    """'jax/_src/nn/functions.py' for a library frame, None for the user's code."""
    real = os.path.realpath(file_name)
    for root, pkg in _ROOTS.items():
        if real.startswith(root):
            rel = pkg + "/" + real[len(root) :].replace(os.sep, "/")
            return None if rel.startswith("jaxdet/models/") else rel  # reference models are user code
    return None


def _api_name(lib_path: str, function: str) -> str:
    for prefix, shown in _PREFIXES:
        if lib_path.startswith(prefix):
            return shown + function
    return lib_path.split("/", 1)[0] + "." + function


@dataclasses.dataclass(frozen=True)
class _Where:
    file: str = ""
    line: int = 0
    function: str = ""


def _locate(eqn) -> tuple[_Where | None, tuple[str, ...]]:
    """The innermost user frame of an equation (None if its traceback has none) and the library
    functions between that frame and the equation, outermost first."""
    tb = getattr(eqn.source_info, "traceback", None)
    frames = list(getattr(tb, "frames", ()) or ())  # innermost first
    apis: list[str] = []
    for fr in frames:
        lib = _library_path(fr.file_name)
        if lib is None:
            return _Where(fr.file_name, int(getattr(fr, "line_num", 0)), fr.function_name), tuple(reversed(apis))
        parts = fr.function_name.split(".")
        if len(parts) > 1 and parts[-1] == "__call__":
            parts = parts[:-1]  # a module's call: name its class (flax's LayerNorm, Dense, ...)
        public = not any(part.startswith(("_", "<")) for part in parts)
        if public and not any(lib.startswith(p) for p in _PLUMBING):
            name = _api_name(lib, ".".join(parts))
            if not apis or apis[-1] != name:
                apis.append(name)
    return None, tuple(reversed(apis))


# ---------------------------------------------------------------------------------------------
# The walk.


class _Walker:
    def __init__(self, backend: str):
        self.backend = backend
        self.found: list[Finding] = []

    def jaxpr(
        self, j1, j2, where: _Where, apis: tuple[str, ...], backward: bool, path: tuple[str, ...], constant=frozenset()
    ):
        eqns2 = j2.eqns if same_structure(j1, j2) else None
        # Values fixed when the program is traced (constants and what is computed from them only):
        # a jaxdet.dropout offset among them is the same for every batch and places no row.
        constant = set(constant) | set(j1.constvars)
        for k, eqn in enumerate(j1.eqns):
            if all(is_literal(v) or v in constant for v in eqn.invars):
                constant.update(eqn.outvars)
            e2 = eqns2[k] if eqns2 is not None else None
            own, own_apis = _locate(eqn)
            # A library's nested equations carry tracebacks that stop inside the library: keep the
            # caller's line and the outer library function's name.
            here = own or where
            eq_apis = own_apis if own is not None else apis + tuple(a for a in own_apis if a not in apis)
            if not own_apis and own is not None and isinstance(eqn.params.get("name"), str):
                eq_apis = (eqn.params["name"],)
            bwd = backward or "transpose(" in str(getattr(eqn.source_info, "name_stack", ""))
            name = eqn.primitive.name
            fixed = tuple(is_literal(v) or v in constant for v in eqn.invars)
            hit = classify(eqn, eqn_axes(eqn, e2), eq_apis, here.function, self.backend, bwd, fixed)
            if hit is not None:
                self.found.append(
                    Finding(
                        kind=hit.kind,
                        primitive=name,
                        shapes=avals_str(eqn),
                        file=here.file,
                        line=here.line,
                        function=here.function,
                        breaks=hit.breaks,
                        why=hit.why,
                        fix=_with_invariant(hit.fix, name),
                        origin=eq_apis[0] if eq_apis else "",
                        backward=bwd,
                        path=" > ".join(path),
                        blocking=hit.blocking,
                    )
                )
            if opaque(eqn):
                continue  # a kernel's own program (Pallas, custom call): reported above as unverified
            label = f"{name}({eqn.params['name']})" if isinstance(eqn.params.get("name"), str) else name
            subs2 = sub_jaxprs(e2.params) if e2 is not None else []
            for i, sub in enumerate(sub_jaxprs(eqn.params)):
                # A call's body takes the call's operands in order (jit, custom_jvp/vjp calls).
                inner = {v for v, f in zip(sub.invars, fixed) if f} if len(sub.invars) == len(eqn.invars) else set()
                self.jaxpr(sub, subs2[i] if i < len(subs2) else None, here, eq_apis, bwd, (*path, label), inner)


# ---------------------------------------------------------------------------------------------
# The public function.


def _backend(backend: str | None) -> str:
    b = (backend or jax.default_backend()).lower()
    if b == "cpu":
        return "cpu"
    if b in ("gpu", "cuda", "rocm"):
        return "gpu"
    raise ValueError(
        f"backend must be 'cpu' or 'gpu' (or 'cuda'/'rocm'), or None for jax.default_backend(); got "
        f"{b!r}: jaxdet audits XLA:CPU and XLA:GPU programs"
    )


def _matcher(ignore) -> Callable[[Finding], bool]:
    if ignore is None:
        return lambda f: False
    if callable(ignore) or isinstance(ignore, str):
        ignore = [ignore]
    if not isinstance(ignore, Iterable):
        raise TypeError(
            "ignore must be a kind, a primitive name, a 'file.py:line' or 'file.py' string, a callable "
            f"Finding -> bool, or a list of them; got {type(ignore).__name__}"
        )
    rules = list(ignore)
    for r in rules:
        if not (callable(r) or isinstance(r, str)):
            raise TypeError(f"ignore entries must be strings or callables (Finding -> bool), got {r!r}")

    def match(f: Finding) -> bool:
        for r in rules:
            if callable(r):
                if r(f):
                    return True
            elif (
                r in (f.kind, f.primitive)
                or (":" in r and f.location.endswith(r))
                or (r.endswith(".py") and f.file.endswith(r))
            ):
                return True
        return False

    return match


def _merge(findings: list[Finding]) -> list[Finding]:
    merged: dict[tuple, Finding] = {}
    for f in findings:
        key = (f.kind, f.primitive, f.shapes, f.file, f.line, f.origin, f.backward, f.path, f.blocking)
        merged[key] = dataclasses.replace(merged[key], count=merged[key].count + 1) if key in merged else f
    return list(merged.values())


def _dce(closed):
    try:
        from jax._src.interpreters import partial_eval as pe

        jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
        return jaxpr
    except Exception:  # noqa: BLE001 - a private API: without it, dead equations are audited too
        return closed.jaxpr


def _doubled(x):
    shape = tuple(np.shape(x))
    if not shape:
        return x
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    return jax.ShapeDtypeStruct((max(2 * shape[0], 1),) + shape[1:], dtype)


def _index_list(value, name, nargs, *, allow_none=False):
    if value is None and allow_none:
        return None
    items = (value,) if isinstance(value, int) else tuple(value)
    for i in items:
        if not isinstance(i, int) or isinstance(i, bool) or not -nargs <= i < nargs:
            raise ValueError(
                f"{name} must index the example arguments 0..{nargs - 1} (int or sequence of ints), got {value!r}"
            )
    return tuple(sorted({i % nargs for i in items}))


def audit(
    fn: Callable,
    *example_args,
    backend: str | None = None,
    batch_argnums: int | Sequence[int] | None = None,
    ignore=None,
    strict: bool = False,
    invariants: Sequence[str] = (BATCH, RUN, DEVICES),
    static_argnums: int | Sequence[int] = (),
    **example_kwargs,
) -> AuditReport:
    """List the operations of ``fn`` that can break batch invariance, run-to-run determinism or
    device-count invariance on ``backend``, with their source lines and fixes.

    Args:
      fn: the function you jit, called as ``fn(*example_args, **example_kwargs)``. To audit the
        backward pass, pass the function that differentiates (the whole train step, or
        ``jax.grad(loss)``): a forward function's jaxpr has no backward.
      example_args: arrays or ``jax.ShapeDtypeStruct``s of the shapes you run; only shapes and dtypes
        are used, nothing is computed.
      backend: ``'cpu'`` or ``'gpu'`` (default ``jax.default_backend()``): whose rules apply. The
        jaxpr is the one traced here (a GPU-only choice such as cuDNN attention shows up only when
        traced on a GPU).
      batch_argnums: the arguments whose leaves carry the batch on their leading axis. With it,
        ``fn`` is traced again at twice the batch, and only operations whose shapes grow with the
        batch are batch hazards (the optimizer's reductions over parameters are not); reductions
        are reported as within rows or across rows. Without it, every float reduction and GEMM is
        reported.
      ignore: findings to drop: a kind (``"rng"``), a primitive (``"dot_general"``), a location
        (``"model.py:42"`` or ``"model.py"``), a callable ``Finding -> bool``, or a list of them.
      strict: also fail on operations the audit cannot see into (custom calls, Pallas kernels,
        callbacks, unknown primitives); by default they are listed as notes.
      invariants: which of ``"batch"``, ``"run-to-run"``, ``"device-count"`` to audit (default all):
        e.g. ``("batch", "run-to-run")`` for inference, where no sum runs across rows or devices.
      static_argnums: as in ``jax.jit``.
      example_kwargs: keyword arguments for ``fn`` (traced as constants).

    Returns an ``AuditReport`` (``.findings``, ``.ok``, a readable ``str``). In CI:
    ``report = jaxdet.audit(step, params, batch, batch_argnums=1); assert report.ok, report``.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(strict, bool):
        raise TypeError(f"strict must be a bool, got {strict!r}")
    wanted = (invariants,) if isinstance(invariants, str) else tuple(invariants)
    if not wanted or any(w not in (BATCH, RUN, DEVICES) for w in wanted):
        raise ValueError(f"invariants must be a non-empty subset of {(BATCH, RUN, DEVICES)}, got {invariants!r}")
    name = _backend(backend)
    match = _matcher(ignore)
    nargs = len(example_args)
    static = _index_list(static_argnums, "static_argnums", nargs) if nargs else ()
    batch = _index_list(batch_argnums, "batch_argnums", nargs, allow_none=True) if nargs or batch_argnums else None
    if batch is not None and set(batch) & set(static):
        raise ValueError(f"batch_argnums {batch_argnums!r} names a static argument ({static_argnums!r})")
    dyn = [i for i in range(nargs) if i not in static]

    def call(*dyn_args):
        args = list(example_args)
        for i, a in zip(dyn, dyn_args):
            args[i] = a
        nnx = graph_state.nnx_module((args, example_kwargs))
        if nnx is None:
            return fn(*args, **example_kwargs)
        # An NNX step changes its objects in place (the optimizer updates the model): their new
        # state is returned too, so the backward that feeds it is not dropped as dead code.
        pure, pure_args, _ = graph_state.as_pure(nnx, fn, tuple(args), example_kwargs)
        return pure(*pure_args)

    jaxpr = _dce(jax.make_jaxpr(call)(*[example_args[i] for i in dyn]))
    doubled = None
    if batch:
        args2 = [jax.tree.map(_doubled, example_args[i]) if i in batch else example_args[i] for i in dyn]
        try:
            doubled = _dce(jax.make_jaxpr(call)(*args2))
        except Exception:  # noqa: BLE001 - fn may accept only this batch size: then batch axes are unknown
            doubled = None
    walker = _Walker(name)
    walker.jaxpr(jaxpr, doubled, _Where(), (), False, ())
    findings = []
    for f in _merge(walker.found):
        if f.blocking and f.breaks and not set(f.breaks) & set(wanted):
            continue
        findings.append(
            dataclasses.replace(
                f, breaks=tuple(b for b in f.breaks if b in wanted) or f.breaks, blocking=f.blocking or strict
            )
        )
    kept = tuple(f for f in findings if not match(f))
    return AuditReport(
        findings=kept,
        backend=name,
        strict=strict,
        ignored=tuple(f for f in findings if match(f)),
        batch_axes=batch is not None and doubled is not None,
    )


# `jaxdet.audit` is the function (the package exports it): its types and invariant names are
# reachable from it too.
audit.Finding = Finding
audit.AuditReport = AuditReport
audit.BATCH, audit.RUN, audit.DEVICES = BATCH, RUN, DEVICES
