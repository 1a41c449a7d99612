"""What the tests of a contracts module (jaxdet/_src/<op>/contracts.py) share: the dtypes they run over, and
asserting a check's (ok, detail)."""

import jax.numpy as jnp

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]


def expect(result):
    ok, detail = result
    assert ok, detail
