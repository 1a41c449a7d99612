"""optax's own tests of ``clip_by_global_norm``, run against ``jaxdet.optax.clip_by_global_norm``.

The test modules ship in the installed optax wheel. Each case below runs one of optax's test methods
unchanged, with optax's ``clip_by_global_norm`` replaced by jaxdet's (monkeypatched where the test
module looks it up). A drop-in must accept what optax accepts, e.g. ``update(updates, None)``.
Cases that differ on purpose (docs/clipping.md, "optax drop-in") are asserted as differences.
Skipped when optax (or absl, which its tests use) is not installed.
"""

import importlib
import unittest

import jax
import pytest

optax = pytest.importorskip("optax")
pytest.importorskip("absl.testing.absltest")

import jaxdet  # noqa: E402


@pytest.fixture
def jaxdet_clip(monkeypatch):
    from optax import transforms  # noqa: PLC0415
    from optax.transforms import _clipping  # noqa: PLC0415

    for module in (optax, transforms, _clipping):
        monkeypatch.setattr(module, "clip_by_global_norm", jaxdet.optax.clip_by_global_norm)


def run_upstream(module: str, cls: str, method: str) -> unittest.TestResult:
    """Run one of optax's test methods; fail with its own message if it fails or errors."""
    try:
        case = getattr(importlib.import_module(module), cls)(method)
    except (ImportError, AttributeError) as e:  # an optax version without this test
        pytest.skip(f"{module}.{cls}.{method} is not in this optax: {e}")
    result = unittest.TestResult()
    case.run(result)
    problems = [text for _, text in result.errors + result.failures]
    assert not problems, f"optax's {cls}.{method} against jaxdet:\n" + "\n".join(problems)
    assert result.testsRun == 1 and not result.skipped
    return result


UPSTREAM_CASES = [
    # Clips to 1/i for 50 values of i; clipping clipped updates changes nothing (optax's tolerance).
    ("optax.transforms._clipping_test", "ClippingTest", "test_clip_by_global_norm"),
    # In a chain after sgd with a snapshot / measure_with_ema of the pre-clip norm.
    ("optax.transforms._monitoring_test", "MonitoringTest", "test_snapshot"),
    ("optax.transforms._monitoring_test", "MonitoringTest", "test_monitor"),
    # inject_hyperparams: max_norm becomes a traced hyperparameter changed between jitted steps.
    ("optax.schedules._inject_test", "InjectHyperparamsTest", "test_overriding_hyperparam"),
]


@pytest.mark.parametrize("module,cls,method", UPSTREAM_CASES, ids=[c[2] for c in UPSTREAM_CASES])
def test_optax_upstream_clip_by_global_norm(jaxdet_clip, module, cls, method):
    assert optax.transforms._clipping.clip_by_global_norm is jaxdet.optax.clip_by_global_norm
    run_upstream(module, cls, method)


def test_optax_upstream_float64_differs_on_purpose(jaxdet_clip):
    # optax clips float64 leaves under jax_enable_x64; jaxdet's kernels take float32 / bfloat16 /
    # float16 only and say so, naming the leaf (docs/clipping.md).
    try:
        case = importlib.import_module("optax._src.float64_test").Float64Test(
            "test_mixed_dtype_input_outputs_clip_by_global_norm"
        )
    except (ImportError, AttributeError) as e:
        pytest.skip(f"optax's float64 test is not in this optax: {e}")
    result = unittest.TestResult()
    try:
        case.run(result)
    finally:
        jax.config.update("jax_enable_x64", False)  # the test sets it and resets it only on success
    assert result.testsRun == 1 and len(result.errors) == 1, result.errors + result.failures
    message = result.errors[0][1]
    assert "TypeError" in message and "leaf [1]" in message and "float64" in message, message
