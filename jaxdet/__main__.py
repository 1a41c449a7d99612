"""`python -m jaxdet`: this build's determinism facts, measured on the current device.

Runs every primitive's checks, shows progress, prints a table, and exits non-zero if a contract fails.
A check returns (ok, detail) with ok True (holds), False (broken) or None (not measurable here).
"""

from __future__ import annotations

import importlib
import sys
import time

import jax

import jaxdet

FACT_MODULES = ["jaxdet._facts_dropout", "jaxdet._facts_matmul", "jaxdet._facts_clip"]


def _collect():
    checks = []
    for name in FACT_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:
                continue
            raise
        checks.extend(module.report_checks())
    return checks


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:48]:<48}")
    sys.stderr.flush()


def main() -> int:
    device = jax.devices()[0]
    print(f"jaxdet {jaxdet.__version__} | jax {jax.__version__} | device: {device.platform} "
          f"({getattr(device, 'device_kind', '?')}) | CUDA kernels built: {jaxdet.WITH_CUDA}")
    checks = _collect()
    rows, failed, skipped = [], 0, 0
    for i, (name, fn) in enumerate(checks):
        _progress(i, len(checks), name)
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as err:  # a crash is a failed contract, reported, not hidden
            ok, detail = False, f"{type(err).__name__}: {err}"
        rows.append((ok, name, detail, time.perf_counter() - start))
        failed += ok is False
        skipped += ok is None
    _progress(len(checks), len(checks), "done")
    sys.stderr.write("\n")
    width = max(len(r[1]) for r in rows) if rows else 10
    for ok, name, detail, seconds in rows:
        status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{status}  {name:<{width}}  {detail}  ({seconds:.1f} s)")
    print(f"{len(rows) - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
