"""jaxdet: bitwise-reproducible training primitives for JAX (XLA FFI kernels on CPU and CUDA)."""

from jaxdet import random
from jaxdet._ffi import WITH_CUDA, CudaNotBuiltError
from jaxdet.dropout import dropout
from jaxdet.matmul import WGRAD_CHUNK_TOKENS, matmul, matmul_weight_grad
from jaxdet.clip import clip_by_global_norm, global_norm
from jaxdet import optax  # noqa: E402 (imports optax lazily)

__version__ = "0.1.0"
__all__ = [
    "dropout",
    "matmul",
    "matmul_weight_grad",
    "WGRAD_CHUNK_TOKENS",
    "clip_by_global_norm",
    "global_norm",
    "optax",
    "random",
    "WITH_CUDA",
    "CudaNotBuiltError",
    "__version__",
]
