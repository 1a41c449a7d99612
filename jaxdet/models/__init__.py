"""Reference models (not imported by ``import jaxdet``): `decoder` is built from jaxdet's own ops;
`plain_llama` is written in plain JAX with no jaxdet call, the model `jaxdet.invariant` is proved
and measured on. Their configurations share `config.DecoderSizes` (the sizes, checked once)."""
