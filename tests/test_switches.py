"""The testing switch JAXDET_TESTING (jaxdet/_src/core/switches.py, cuda/common/testing.h; docs/DEVELOPING.md)."""

import os
import subprocess
import sys
import tempfile

import pytest

from jaxdet import _native
from jaxdet._src.core.switches import (
    TESTING_ENV,
    active_testing_overrides,
    parse_testing_overrides,
    validate_testing_env,
)


def test_parse_accepted_items():
    assert parse_testing_overrides(None) == {}
    assert parse_testing_overrides("") == {}
    assert parse_testing_overrides(" gemm=sm80 , cpu_gemm=generic,") == {"gemm": "sm80", "cpu_gemm": "generic"}


@pytest.mark.parametrize("value", ["gemm", "gemm=sm70", "raster=n", "cpu_gemm=avx2,cpu_gemm=generic", "=sm80"])
def test_parse_refuses_unknown_or_malformed_items(value):
    with pytest.raises(ValueError, match=TESTING_ENV) as info:
        parse_testing_overrides(value)
    assert "gemm=sm80" in str(info.value) and "cpu_gemm=avx512|avx2|generic" in str(info.value)


def test_validate_reads_the_environment():
    assert validate_testing_env({}) == {}
    assert validate_testing_env({TESTING_ENV: "cpu_gemm=generic"}) == {"cpu_gemm": "generic"}
    with pytest.raises(ValueError, match="JAXDET_TESTING"):
        validate_testing_env({TESTING_ENV: "gemm=sm90"})


def _run(code, testing):
    env = dict(os.environ, **{TESTING_ENV: testing})
    # From outside the source checkout, whose jaxdet/ folder would shadow the installed package.
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=tempfile.gettempdir()
    )


def test_native_code_reads_the_switch_once_per_process():
    code = (
        "from jaxdet._src.core.switches import active_testing_overrides; from jaxdet import _native\n"
        "print(sorted(active_testing_overrides().items()), _native.cpu_gemm_isa())"
    )
    r = _run(code, "cpu_gemm=generic, gemm=sm80")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["[('cpu_gemm',", "'generic'),", "('gemm',", "'sm80')]", "generic"]
    if TESTING_ENV not in os.environ:
        assert active_testing_overrides() == {}
        assert _native.cpu_gemm_isa() == _native.cpu_gemm_variants()[0]


def test_native_code_refuses_an_unknown_cpu_variant():
    """Never a silent fallback: past the import-time check (the variable set after `import jaxdet`,
    before the native code first reads it), the CPU GEMM fails with the variable's name."""
    code = (
        "import os, jax.numpy as jnp, jaxdet\n"
        "os.environ['JAXDET_TESTING'] = 'cpu_gemm=sse2'\n"
        "try:\n"
        "    jaxdet.matmul(jnp.ones((2, 3)), jnp.ones((3, 4))).block_until_ready()\n"
        "except Exception as e:\n"
        "    print('ERROR', e)\n"
    )
    r = _run(code, "")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ERROR" in r.stdout and "JAXDET_TESTING has cpu_gemm=sse2" in r.stdout, r.stdout


def test_a_mistyped_switch_fails_at_import(tmp_path):
    import subprocess
    import sys

    env = dict(__import__("os").environ, **{TESTING_ENV: "gemm=sm90"})
    proc = subprocess.run(
        [sys.executable, "-c", "import jaxdet"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "JAXDET_TESTING" in proc.stderr and "gemm=sm80" in proc.stderr, proc.stderr


def test_the_report_names_active_overrides(tmp_path):
    import subprocess
    import sys

    env = dict(__import__("os").environ, **{TESTING_ENV: "cpu_gemm=generic"})
    proc = subprocess.run(
        [sys.executable, "-m", "jaxdet", "report", "-k", "philox"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "testing overrides active (JAXDET_TESTING=cpu_gemm=generic)" in proc.stdout
