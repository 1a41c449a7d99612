"""jaxdet's contracts as check functions: one source of truth for the report and the tests.

Each primitive's module here has ``report_checks() -> [(name, check)]``. A check takes no argument and
returns ``(ok, detail)``: ``ok`` is True (the contract holds on this device), False (broken) or None
(not measurable here, e.g. CPU == GPU on a machine without a GPU). ``jaxdet report`` runs them all;
the test suite runs the same functions (tests/test_contracts.py) and asserts ``ok is not False``.
"""

from __future__ import annotations

import importlib

MODULES = ("dropout", "matmul", "clip", "parallel", "norm", "softmax", "attention")


def all_checks():
    """[(name, check)] for every primitive whose contracts module exists in this build."""
    checks = []
    for name in MODULES:
        try:
            module = importlib.import_module(f"jaxdet.contracts.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"jaxdet.contracts.{name}":
                continue
            raise
        checks.extend(module.report_checks())
    return checks
