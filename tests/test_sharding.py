"""jaxdet on many devices: every contract of docs/sharding.md, on 8 simulated CPU devices.

XLA's CPU device count is fixed when the backend starts, so when this process has fewer than 8
devices the file runs itself once in a child pytest with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and each test here reports its outcome there.
"""

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

import jaxdet
from bitwise import assert_bitwise

NDEV = 8
IN_CHILD = len(jax.devices("cpu")) >= NDEV


@functools.lru_cache(maxsize=None)
def _child_outcomes():
    """Runs this file in a child pytest on NDEV CPU devices: {test name: (outcome, message)}."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NDEV}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.xml")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", __file__],
            cwd=tmp, env=env, capture_output=True, text=True, timeout=3600,
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

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        name = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].rsplit(" ", 1)[0]
        outcome, message = _child_outcomes().get(name, ("missing", "no result from the child pytest"))
        if outcome == "skipped":
            pytest.skip(message)
        if outcome != "passed":
            pytest.fail(f"on {NDEV} devices ({outcome}): {message}", pytrace=False)

    return wrapper


def mesh(n=NDEV, names=("data",), shape=None):
    shape = shape or (n,)
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:n])


def rand(shape, dtype=jnp.float32, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32), dtype)


# ---- shard_map: the outputs keep the varying-axes type of their inputs. ----

@on_devices
def test_outputs_vary_like_their_inputs_under_shard_map():
    m = mesh()
    a, b = rand((64, 96), seed=1), rand((96, 16), seed=2)
    key = jaxdet.random.key(3)

    def types(a, b, key):
        out = {
            "matmul": jaxdet.matmul(a, b),
            "dropout": jaxdet.dropout(a, key, 0.5),
            "fold_in": jaxdet.random.fold_in(key, 1),
        }
        return {k: jax.typeof(v).mat.varying for k, v in out.items()}

    seen = {}

    def record(a, b, key):
        seen.update(types(a, b, key))
        return a

    jax.shard_map(record, mesh=m, in_specs=(P("data"), P(), P()), out_specs=P("data"))(a, b, key)
    assert seen == {"matmul": {"data"}, "dropout": {"data"}, "fold_in": frozenset()}
    # A varying result cannot be returned as replicated (it used to return one shard's rows).
    with pytest.raises(ValueError, match="out_specs"):
        jax.shard_map(jaxdet.matmul, mesh=m, in_specs=(P("data"), P()), out_specs=P())(a, b)
    out = jax.shard_map(jaxdet.matmul, mesh=m, in_specs=(P("data"), P()), out_specs=P("data"))(a, b)
    assert_bitwise(out, jaxdet.matmul(a, b))
