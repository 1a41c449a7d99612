"""`python -m jaxdet` (the README's first command) runs every check and fails loudly."""

import subprocess
import sys


def test_main_report_runs_and_passes(tmp_path):
    # From an empty directory, so that the installed package runs (not a source checkout).
    proc = subprocess.run([sys.executable, "-m", "jaxdet"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "philox: known-answer vectors" in proc.stdout
    assert " 0 failed" in proc.stdout
    assert "FAIL" not in proc.stdout
