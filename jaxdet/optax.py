"""jaxdet's global-norm clipping as an optax ``GradientTransformation`` (docs/clipping.md)."""

from jaxdet._src.clip.optax import ClipByGlobalNormState, clip_by_global_norm, last_norm

__all__ = ["clip_by_global_norm", "ClipByGlobalNormState", "last_norm"]
