"""Every notebook in notebooks/ runs top to bottom on the CPU (their cells assert what they show)."""

import os
import pathlib

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))


@pytest.fixture
def cpu_kernel_env(monkeypatch):
    # The notebook kernel inherits the environment: CPU backend, headless plots.
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # A notebook's helper modules lie beside it (notebooks/rl_toy.py), as when run from its folder.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(NOTEBOOKS_DIR), os.environ.get("PYTHONPATH")])))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, cpu_kernel_env):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, (
                f"{path.name} is committed with outputs; clear them"
            )
    # Run from an empty directory so the installed jaxdet is imported (not a source checkout).
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "jaxdet" in text or "kept" in text
