"""Flax NNX drop-ins on jaxdet's ops (docs/flax.md): ``Linear``, ``Embed``, ``LayerNorm``,
``RMSNorm``, ``Dropout``, ``dot_product_attention`` (an ``attention_fn`` for
``nnx.MultiHeadAttention``), ``dot_general`` (for flax's own modules) and ``DotGeneral`` (for
linen's ``nn.Dense(dot_general_cls=...)``). Needs flax; ``import jaxdet`` alone never imports it."""

try:
    import flax.nnx  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised in a subprocess by tests/test_nnx.py
    raise ImportError("jaxdet.nnx needs Flax (NNX), which is not installed: pip install flax") from e

from jaxdet._src.nnx.attention import dot_product_attention
from jaxdet._src.nnx.linear import DotGeneral, Embed, Linear, dot_general
from jaxdet._src.nnx.normalization import LayerNorm, RMSNorm
from jaxdet._src.nnx.stochastic import Dropout

__all__ = [
    "Linear",
    "Embed",
    "LayerNorm",
    "RMSNorm",
    "Dropout",
    "dot_product_attention",
    "dot_general",
    "DotGeneral",
]
