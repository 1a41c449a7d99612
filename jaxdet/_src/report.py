"""The ``jaxdet`` command line: ``jaxdet report`` measures this build's determinism contracts.

``jaxdet report`` (also ``python -m jaxdet``) runs every primitive package's contract checks on the current
default device, shows progress, prints one line per contract (PASS, FAIL, or SKIP when it cannot be
measured here) and exits 1 if any contract is broken.
"""

from __future__ import annotations

import argparse
import sys
import time

REPORT_HELP = """\
Measure this build's determinism contracts on the current default device.

Each line is one contract, checked bit for bit (docs/ states each one next to the test that proves
it): PASS (holds here), FAIL (broken: the exit status is 1) or SKIP (cannot be measured here, e.g.
CPU == GPU on a machine without a GPU). The device is JAX's default: set JAX_PLATFORMS=cpu to check
the CPU kernels on a GPU machine. Active testing overrides (JAXDET_TESTING) are printed first.
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxdet",
        description="jaxdet: bitwise-reproducible training primitives for JAX.",
        epilog="Without a command, `jaxdet` (and `python -m jaxdet`) runs `report`.",
    )
    parser.add_argument("--version", action="store_true", help="print jaxdet's and jax's versions and exit")
    commands = parser.add_subparsers(dest="command", metavar="command")
    report = commands.add_parser(
        "report",
        help="measure this build's determinism contracts on the current device",
        description=REPORT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    report.add_argument("-k", "--only", metavar="TEXT", help="run only the checks whose name contains TEXT")
    report.add_argument("--list", action="store_true", help="list the checks' names without running them")
    return parser


def _progress(done: int, total: int, label: str) -> None:
    if not sys.stderr.isatty():
        return
    width = 30
    filled = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label[:48]:<48}")
    sys.stderr.flush()


def run_report(only: str | None = None, list_only: bool = False) -> int:
    import jax

    import jaxdet
    from jaxdet._src.core import contracts, switches

    checks = contracts.all_checks()
    if only:
        checks = [(name, fn) for name, fn in checks if only in name]
    if list_only:
        for name, _ in checks:
            print(name)
        return 0
    device = jax.devices()[0]
    print(
        f"jaxdet {jaxdet.__version__} | jax {jax.__version__} | device: {device.platform} "
        f"({getattr(device, 'device_kind', '?')}) | CUDA kernels built: {jaxdet.WITH_CUDA}"
    )
    overrides = switches.active_testing_overrides()
    if overrides:
        items = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
        print(f"testing overrides active ({switches.TESTING_ENV}={items}): the kernels below are not the default ones")
    rows, failed, skipped = [], 0, 0
    for i, (name, fn) in enumerate(checks):
        _progress(i, len(checks), name)
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as err:  # a crash is a broken contract, reported, not hidden
            ok, detail = False, f"{type(err).__name__}: {err}"
        rows.append((ok, name, detail, time.perf_counter() - start))
        failed += ok is False
        skipped += ok is None
    _progress(len(checks), len(checks), "done")
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    width = max((len(r[1]) for r in rows), default=10)
    for ok, name, detail, seconds in rows:
        status = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{status}  {name:<{width}}  {detail}  ({seconds:.1f} s)")
    print(f"{len(rows) - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


def cli(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.version:
        import jax

        import jaxdet

        print(f"jaxdet {jaxdet.__version__} (jax {jax.__version__}, CUDA kernels built: {jaxdet.WITH_CUDA})")
        return 0
    if args.command in (None, "report"):
        return run_report(getattr(args, "only", None), getattr(args, "list", False))
    return 2  # argparse rejects unknown commands before this


if __name__ == "__main__":
    sys.exit(cli())
