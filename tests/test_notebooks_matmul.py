"""Executes notebooks/batch_invariance.ipynb on the CPU (outputs are kept out of git)."""

import os
import pathlib

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "batch_invariance.ipynb"


def test_batch_invariance_notebook_runs_on_cpu():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, "commit the notebook with outputs cleared"
    env_before = {k: os.environ.get(k) for k in ("JAX_PLATFORMS", "MPLBACKEND")}
    os.environ["JAX_PLATFORMS"] = "cpu"  # the kernel inherits the environment
    os.environ["MPLBACKEND"] = "Agg"
    try:
        client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                         resources={"metadata": {"path": str(NOTEBOOK.parent)}})
        client.execute()
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "jaxdet" in text
