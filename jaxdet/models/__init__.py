"""Reference models (not imported by ``import jaxdet``): `decoder` is built from jaxdet's own ops;
`plain_llama` is written in plain JAX with no jaxdet call, the model `jaxdet.invariant` is proved
and measured on (their configurations share `config.DecoderSizes`, the sizes checked once);
`llama` is a Llama-style decoder in Flax NNX on the `jaxdet.nnx` drop-ins (or flax's own
modules), with the Llama checkpoint names (docs/flax.md)."""
