"""GPU: the CUDA GEMM kernels behind jaxdet_gemm / jaxdet_gemm_wgrad, through the raw FFI targets.

Runs benchmarks/gemm_kernels_check.py (accuracy vs float64, row invariance, weight-gradient chunk
semantics, edge cases, alignment errors) in a subprocess, once with the default kernels and once
with the testing switch JAXDET_TESTING=gemm=sm80 (read once per process, hence the subprocess).
docs/matmul_cuda.md.
"""

import os
import subprocess
import sys

import pytest

CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gemm_kernels_check.py")


@pytest.mark.gpu
@pytest.mark.parametrize("testing", ["", "gemm=sm80"], ids=["default", "sm80"])
def test_gemm_cuda_kernels(testing):
    env = dict(os.environ, JAXDET_TESTING=testing)
    r = subprocess.run([sys.executable, CHECK, "--quick"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ALL PASS" in r.stdout, r.stdout[-4000:] + r.stderr[-4000:]
