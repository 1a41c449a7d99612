"""jaxdet: bitwise-reproducible training primitives for JAX (XLA FFI kernels on CPU and CUDA)."""

from jaxdet import random
from jaxdet._ffi import WITH_CUDA, CudaNotBuiltError
from jaxdet.dropout import dropout

__version__ = "0.1.0"
__all__ = ["dropout", "random", "WITH_CUDA", "CudaNotBuiltError", "__version__"]
