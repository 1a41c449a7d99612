"""Shared test fixtures. Tests marked `gpu` run only where JAX sees a GPU and jaxdet has CUDA kernels
(`pytest -m gpu` on a GPU machine); everything else runs on the CPU backend."""

import os

import jax
import pytest

import jaxdet

# pytest-xdist workers sharing one GPU (`pytest -m gpu -n 6`): each takes GPU memory as it needs it,
# instead of preallocating most of the card (read when JAX first starts its GPU backend).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def gpu_available() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available() and jaxdet.WITH_CUDA:
        return
    reason = "needs an NVIDIA GPU and a CUDA build of jaxdet"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def cpu():
    return jax.devices("cpu")[0]


@pytest.fixture
def gpu():
    return jax.devices("gpu")[0]


@pytest.fixture
def on_gpu(gpu):
    """The GPU as JAX's default device for the whole test."""
    with jax.default_device(gpu):
        yield gpu
