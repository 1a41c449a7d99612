"""jaxdet: bitwise-reproducible training primitives for JAX (XLA FFI kernels on CPU and CUDA)."""

from jaxdet import random
from jaxdet._ffi import WITH_CUDA, CudaNotBuiltError
from jaxdet.dropout import dropout
from jaxdet.matmul import WGRAD_CHUNK_TOKENS, matmul, matmul_weight_grad

__version__ = "0.1.0"
__all__ = [
    "dropout",
    "matmul",
    "matmul_weight_grad",
    "WGRAD_CHUNK_TOKENS",
    "random",
    "WITH_CUDA",
    "CudaNotBuiltError",
    "__version__",
]
