"""`python -m jaxdet` (the README's first command) runs every check and fails loudly."""

import subprocess
import sys


def test_main_report_runs_and_passes():
    proc = subprocess.run([sys.executable, "-m", "jaxdet"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "philox: known-answer vectors" in proc.stdout
    assert " 0 failed" in proc.stdout
    assert "FAIL" not in proc.stdout
