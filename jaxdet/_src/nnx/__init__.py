"""Flax NNX drop-ins built on jaxdet's ops (public as ``jaxdet.nnx``; imports flax, so ``import jaxdet``
never imports this package)."""
