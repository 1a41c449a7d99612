"""Walking jaxprs: the sub-jaxprs an equation carries (for checks that look inside a traced program)."""

from __future__ import annotations


def sub_jaxprs(params) -> list:
    """The jaxprs an equation carries (call bodies, branches, scan/while bodies, update functions),
    in parameter order, each as an open jaxpr."""
    found = []
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(v, "jaxpr", v)  # a ClosedJaxpr holds its Jaxpr in .jaxpr
            if hasattr(inner, "eqns") and hasattr(inner, "invars"):
                found.append(inner)
    return found


def is_literal(v) -> bool:
    """Whether an equation operand is a Literal (a value written into the jaxpr), not a variable."""
    return hasattr(v, "val") and not hasattr(v, "count")


def is_jaxdet(eqn) -> bool:
    """Whether the equation is one of jaxdet's own primitives (or a raw FFI call of its targets)."""
    name = eqn.primitive.name
    return name.startswith("jaxdet_") or (
        name == "ffi_call" and str(eqn.params.get("target_name", "")).startswith("jaxdet_")
    )
