"""Sampling with a KV cache and the trainer's log-probs, bit for bit the same (docs/sampling.md,
docs/rl.md): ``Sampler``, ``Completion``, ``trainer_log_probs``, ``completions_log_probs``,
``pad_sequences``, ``pack_sequences``, ``Layout``. Needs Flax (``pip install flax``)."""

try:
    import flax  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError("jaxdet.sampling needs Flax NNX models: pip install flax") from err

from jaxdet._src.sampling.sampler import Completion, Sampler
from jaxdet._src.sampling.sampling_math import SAMPLE_TAG, inverse_temperature
from jaxdet._src.sampling.trainer import (
    Layout,
    completions_log_probs,
    pack_sequences,
    pad_sequences,
    trainer_log_probs,
)

__all__ = [
    "Sampler",
    "Completion",
    "trainer_log_probs",
    "completions_log_probs",
    "pad_sequences",
    "pack_sequences",
    "Layout",
    "inverse_temperature",
    "SAMPLE_TAG",
]
