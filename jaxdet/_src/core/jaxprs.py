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
