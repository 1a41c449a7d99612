"""The README's main job (`jaxdet report`) and its `python -m jaxdet` form, run as a new user would."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _jaxdet_script():
    script = shutil.which("jaxdet") or os.path.join(os.path.dirname(sys.executable), "jaxdet")
    if not os.path.exists(script):
        pytest.skip("the `jaxdet` console script is not installed next to this Python")
    return script


def test_report_runs_every_contract_and_passes(tmp_path):
    proc = subprocess.run([_jaxdet_script(), "report"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "philox: known-answer vectors" in proc.stdout
    assert " 0 failed" in proc.stdout
    assert "FAIL" not in proc.stdout


def test_report_runs_from_the_source_checkout_root():
    """The README runs `jaxdet report` from the clone's root: checks that start subprocesses must
    not import the source folder there."""
    if not (REPO / "CMakeLists.txt").exists():
        pytest.skip("not a source checkout")
    proc = subprocess.run(
        [_jaxdet_script(), "report", "-k", "parallel"], capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS  parallel" in proc.stdout, proc.stdout


def test_report_help_explains_itself_without_running_checks(tmp_path):
    for argv in ([_jaxdet_script(), "report", "--help"], [sys.executable, "-m", "jaxdet", "--help"]):
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "usage: jaxdet" in proc.stdout
        assert re.search(r"\d+ passed", proc.stdout) is None, proc.stdout


def test_python_m_jaxdet_runs_the_report_from_any_directory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdet", "report", "-k", "philox"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS  philox: known-answer vectors" in proc.stdout


def test_python_m_jaxdet_in_the_source_root_says_why_it_cannot_run():
    if not (REPO / "CMakeLists.txt").exists():
        pytest.skip("not a source checkout")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdet", "--version"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode != 0
    assert "source folder" in proc.stderr and "jaxdet report" in proc.stderr, proc.stderr
