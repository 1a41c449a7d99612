"""Registration and lowering rules shared by every primitive (jaxdet/_src/core/ffi.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdet
from jaxdet._src.core import ffi as _ffi


def test_cpu_targets_are_registered_and_cuda_ones_match_the_build():
    for name in (
        "jaxdet_philox4x32_10",
        "jaxdet_dropout",
        "jaxdet_gemm",
        "jaxdet_gemm_wgrad",
        "jaxdet_gemm_wgrad_init",
        "jaxdet_global_norm",
        "jaxdet_clip_global_norm",
    ):
        assert name in _ffi.CPU_TARGETS
        assert (name in _ffi.CUDA_TARGETS) == jaxdet.WITH_CUDA


def test_a_gpu_lowering_without_cuda_kernels_raises_a_clear_error():
    # A primitive whose target has no CUDA handler (what every primitive is in a CPU-only build):
    # exporting it for CUDA must fail loudly, never fall back to another implementation.
    prim = _ffi.define_primitive(
        "jaxdet_test_no_cuda_handler", lambda x: jax.core.ShapedArray(x.shape, x.dtype), attributes=lambda: {}
    )
    f = jax.jit(lambda x: prim.bind(x))
    with pytest.raises(_ffi.CudaNotBuiltError, match="no CUDA kernels"):
        jax.export.export(f, platforms=["cuda"])(jax.ShapeDtypeStruct((4,), jnp.float32))


def test_export_for_cuda_names_the_cuda_target_when_built():
    if not jaxdet.WITH_CUDA:
        pytest.skip("CPU-only build")
    f = jax.jit(lambda x, k: jaxdet.dropout(x, k, 0.5))
    # jaxdet targets carry no serialization guarantee; lowering for CUDA is what is checked here.
    unguaranteed = [jax.export.DisabledSafetyCheck.custom_call("jaxdet_dropout")]
    exported = jax.export.export(f, platforms=["cuda"], disabled_checks=unguaranteed)(
        jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((2,), np.uint32)
    )
    assert "jaxdet_dropout" in exported.mlir_module()
