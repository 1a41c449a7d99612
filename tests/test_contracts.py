"""Every contract check of the report (jaxdet._src.core.contracts), run by the test suite: one source of truth.

A check returns (ok, detail); ok None means "not measurable on this device" (e.g. CPU == GPU without
a GPU) and is reported as a skip.
"""

import pytest

from jaxdet._src.core import contracts

CHECKS = contracts.all_checks()


@pytest.mark.parametrize("name,check", CHECKS, ids=[name for name, _ in CHECKS])
def test_contract(name, check):
    ok, detail = check()
    if ok is None:
        pytest.skip(detail)
    assert bool(ok), f"{name}: {detail}"
