"""What the row-op contracts (norm.py, softmax.py) share: the device they measure, CPU == device,
run-to-run, the relative error against float64, and a check run over every kind of the op."""

from __future__ import annotations

import jax
import numpy as np

from jaxdet._src.core.testing import same_bits

ON_CPU = "the default device is the CPU: nothing to compare with (run on a GPU device)"


def default_device():
    return jax.devices()[0]


def cpu_equals_device(value_and_grads, make_inputs, label, names, shapes):
    """(ok, detail): each output (named by `names`) of value_and_grads(*make_inputs(rows, n)) at each
    (rows, n) of `shapes`, computed on the CPU and on the default device, bitwise equal."""
    dev = default_device()
    if dev.platform == "cpu":
        return None, ON_CPU
    cpu = jax.devices("cpu")[0]
    bad = []
    for rows, n in shapes:
        args = make_inputs(rows, n)
        on_cpu = value_and_grads(*jax.device_put(args, cpu))
        on_dev = value_and_grads(*args)
        bad += [f"{name}{[rows, n]}" for name, a, e in zip(names, on_cpu, on_dev) if not same_bits(a, e)]
    ok = not bad
    return ok, (
        f"{label}: CPU vs {dev.device_kind}, {'/'.join(names)} at {len(shapes)} shapes: "
        + ("bitwise equal" if ok else "DIFFER: " + ", ".join(bad))
    )


def same_every_run(run, runs):
    """run() (a tuple of arrays) `runs` times: every run bitwise equal to the first."""
    first = run()
    return all(all(same_bits(a, e) for a, e in zip(run(), first)) for _ in range(runs - 1))


def relative_errors(got, want):
    """Relative-norm error of each array of `got` against its float64 reference in `want`."""
    return [float(np.linalg.norm(np.asarray(a, np.float64) - e) / np.linalg.norm(e)) for a, e in zip(got, want)]


def over_all(check, param, values, **kw):
    """check(param=v) for every v of `values`, as one (ok, detail): None where none was measurable."""
    results = [check(**{param: v}, **kw) for v in values]
    oks = [r[0] for r in results]
    if all(o is None for o in oks):
        return None, results[0][1]
    return all(o is not False for o in oks), "; ".join(r[1] for r in results)


def bitwise_verdict(what: str, differences: list, separator: str = "; "):
    """``(ok, detail)`` of a bitwise comparison: `what` followed by "bitwise equal", or by the differences."""
    ok = not differences
    return ok, what + ("bitwise equal" if ok else separator.join(differences))


def gpu_device():
    """The first GPU when there is one and this build has CUDA kernels, else None."""
    import jaxdet

    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    return gpus[0] if gpus and jaxdet.WITH_CUDA else None
