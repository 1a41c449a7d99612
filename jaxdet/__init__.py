"""jaxdet: bitwise-reproducible training primitives for JAX (XLA FFI kernels on CPU and CUDA)."""


def _require_compiled_extension():
    # From a source checkout's root, `python -m jaxdet` or `import jaxdet` finds the source folder
    # first (the current directory leads sys.path), and it has no compiled kernels.
    import importlib.util
    import pathlib

    if importlib.util.find_spec("jaxdet._native") is not None:
        return
    here = pathlib.Path(__file__).resolve().parent
    if (here.parent / "CMakeLists.txt").exists():
        raise ImportError(
            f"jaxdet was imported from its source folder {here}, which holds no compiled kernels. "
            "Install it (`pip install .`), then run `jaxdet report` (works from any directory), or "
            "`python -m jaxdet` / `import jaxdet` from a directory other than the source checkout's root."
        )
    raise ImportError(f"jaxdet's compiled extension (jaxdet._native) is missing from {here}; reinstall jaxdet")


_require_compiled_extension()

from jaxdet._src.core import switches as _switches  # noqa: E402
from jaxdet._src.core import xla_flags as _xla_flags  # noqa: E402, F401  (before jax starts its backends)

_switches.validate_testing_env()  # a mistyped JAXDET_TESTING is an error, never silently ignored

# The public API. Each primitive lives in its own package, jaxdet/_src/<op>/ (mirroring cuda/<op>/);
# random, parallel, testing, export and optax are public namespaces. A public function carries its
# constants as attributes (jaxdet.attention.KV_SPLIT, jaxdet.softmax.SEGMENT, ...).
from jaxdet import (  # noqa: E402
    export,
    optax,  # imports optax lazily
    parallel,
    random,
    testing,
)
from jaxdet._src.attention.attention import attention
from jaxdet._src.audit.audit import audit
from jaxdet._src.clip.clip import clip_by_global_norm, global_norm
from jaxdet._src.core.ffi import WITH_CUDA, CudaNotBuiltError
from jaxdet._src.dropout.dropout import dropout
from jaxdet._src.embed.embed import embed, segment_sum
from jaxdet._src.invariant.invariant import invariant
from jaxdet._src.matmul.matmul import GEMM_CHUNK, WGRAD_CHUNK_TOKENS, matmul, matmul_weight_grad
from jaxdet._src.norm.norm import layer_norm, rms_norm
from jaxdet._src.reduce.reduce import bias_add, sum
from jaxdet._src.softmax.softmax import (
    label_log_probs,
    log_softmax,
    softmax,
    softmax_cross_entropy,
    softmax_cross_entropy_with_integer_labels,
)

__version__ = "0.1.0"
__all__ = [
    "dropout",
    "embed",
    "segment_sum",
    "matmul",
    "matmul_weight_grad",
    "GEMM_CHUNK",
    "WGRAD_CHUNK_TOKENS",
    "clip_by_global_norm",
    "global_norm",
    "rms_norm",
    "layer_norm",
    "sum",
    "bias_add",
    "softmax",
    "log_softmax",
    "softmax_cross_entropy",
    "softmax_cross_entropy_with_integer_labels",
    "label_log_probs",
    "attention",
    "audit",
    "invariant",
    "optax",
    "export",
    "parallel",
    "testing",
    "random",
    "WITH_CUDA",
    "CudaNotBuiltError",
    "__version__",
]
