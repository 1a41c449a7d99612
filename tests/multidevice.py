"""Running a test file's tests on 8 simulated CPU devices, counting collectives in compiled HLO, and
the meshes, inputs and partitioner switch the many-device tests share.

XLA's CPU device count is fixed when the backend starts, so a file whose tests need NDEV devices
decorates them with ``on_devices``: in a process with fewer devices, the first such test runs the
whole file once in a child pytest with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and
every decorated test reports its outcome from there.
"""

import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding

NDEV = 8
IN_CHILD = len(jax.devices("cpu")) >= NDEV
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@functools.cache
def _child_outcomes(path):
    """Runs the test file `path` in a child pytest on NDEV CPU devices: {test name: (outcome, message)}."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={NDEV}".strip()
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", path],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=3600,
            check=False,
        )
        if not os.path.exists(report):
            raise RuntimeError(f"the {NDEV}-device child pytest did not run:\n{proc.stdout}\n{proc.stderr}")
        outcomes = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for kind in ("failure", "error", "skipped"):
                node = case.find(kind)
                if node is not None:
                    outcome, message = kind, (node.get("message") or "") + "\n" + (node.text or "")
            outcomes[case.get("name")] = (outcome, message)
        return outcomes


def on_devices(fn):
    """Run the test on NDEV devices: here when this process has them, else in the child pytest."""
    if IN_CHILD:
        return fn
    path = sys.modules[fn.__module__].__file__

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        name = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].rsplit(" ", 1)[0]  # with its parameters
        outcome, message = _child_outcomes(path).get(name, ("missing", "no result from the child pytest"))
        if outcome == "skipped":
            pytest.skip(message)
        if outcome != "passed":
            pytest.fail(f"on {NDEV} devices ({outcome}): {message}", pytrace=False)

    return wrapper


def collectives(f, *args):
    """{collective: count} in the compiled (partitioned) HLO of jit(f)(*args)."""
    text = jax.jit(f).lower(*args).compile().as_text()
    found = {k: len(re.findall(rf"\s{k}(?:-start)?\(", text)) for k in COLLECTIVES}
    return {k: n for k, n in found.items() if n}


def mesh(n=NDEV, names=("data",), shape=None):
    """A mesh of the first `n` devices (axis types Auto), 1-D unless `shape` is given."""
    shape = shape or (n,)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:n])


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


def put(x, m, spec):
    return jax.device_put(x, NamedSharding(m, spec))


@contextlib.contextmanager
def partitioner(shardy):
    """Shardy (True) or GSPMD (False) as jit's partitioner inside the block."""
    saved = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", saved)
