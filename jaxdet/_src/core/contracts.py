"""jaxdet's contracts as check functions: one source of truth for the report and the tests.

Every primitive package ``jaxdet._src.<op>`` that has a ``contracts`` module is found here; that
module's ``report_checks() -> [(name, check)]`` lists its checks. A check takes no argument and
returns ``(ok, detail)``: ``ok`` is True (the contract holds on this device), False (broken) or None
(not measurable here, e.g. CPU == GPU on a machine without a GPU). ``jaxdet report`` runs them all;
the test suite runs the same functions (tests/test_contracts.py) and asserts ``ok is not False``.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil

import jaxdet._src


def packages() -> list[str]:
    """The primitive packages that declare contracts, in name order."""
    found = []
    for info in pkgutil.iter_modules(jaxdet._src.__path__):
        if (
            info.ispkg
            and info.name != "core"
            and importlib.util.find_spec(f"jaxdet._src.{info.name}.contracts") is not None
        ):
            found.append(info.name)
    return sorted(found)


def all_checks():
    """[(name, check)] for every primitive package's contracts."""
    checks = []
    for name in packages():
        checks.extend(importlib.import_module(f"jaxdet._src.{name}.contracts").report_checks())
    return checks
