"""jaxdet.testing: the bit comparison and the model-test helpers users run on their own models
(docs/testing.md)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdet
from jaxdet.testing import (
    assert_batch_invariant,
    assert_bitwise_equal,
    assert_deterministic,
    bits,
    count_bit_differences,
    describe_bit_differences,
    same_bits,
)

X = jax.random.normal(jax.random.key(0), (64, 1024), jnp.float32)
W = jax.random.normal(jax.random.key(1), (1024, 256), jnp.float32)


# ---- Bits. ----


def test_bits_see_signed_zero_and_nan_payloads():
    a = np.array([0.0, np.nan], np.float32)
    b = np.array([-0.0, np.nan], np.float32)
    b.view(np.uint32)[1] |= 1  # another NaN payload
    assert count_bit_differences(a, b) == 2 and not same_bits(a, b)
    assert bits(jnp.ones(2, jnp.bfloat16)).dtype == np.uint16
    assert same_bits(a, a.copy())


def test_describe_bit_differences_shows_where_values_bits_and_ulps():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = a.copy()
    b[1, 2] = np.nextafter(b[1, 2], np.float32(np.inf))
    msg = describe_bit_differences(a, b, "y")
    assert msg == (
        "y: 1 of 6 elements differ bitwise; first: (1, 2): 5.0 (0x40a00000) vs 5.0000005 (0x40a00001) [1 ulp]; "
        "largest |difference| 4.77e-07 at (1, 2)"
    )
    assert describe_bit_differences(a, a.copy()) is None
    assert "float32[2, 3] vs float32[3, 2]" in describe_bit_differences(a, a.T)
    h = describe_bit_differences(jnp.ones(3, jnp.bfloat16), jnp.full(3, 1.0078125, jnp.bfloat16), "h")
    assert "3 of 3 elements differ" in h and "(0x3f80) vs 1.00781 (0x3f81) [1 ulp]" in h
    with pytest.raises(AssertionError, match="y: 1 of 6 elements differ bitwise"):
        assert_bitwise_equal(a, b, "y")


# ---- assert_batch_invariant. ----


def test_jaxdet_matmul_is_batch_invariant():
    assert_batch_invariant(lambda b: jaxdet.matmul(b, W), X)
    wb = W.astype(jnp.bfloat16)
    assert_batch_invariant(lambda b: jaxdet.matmul(b, wb), X.astype(jnp.bfloat16), sizes=(1, 3, 64), positions=(0, -1))

    # The backward's dA rows too, over a pytree of outputs.
    def rows_and_grad(b):
        y = jaxdet.matmul(b, W)
        return {"y": y, "dx": jax.grad(lambda v: jnp.sum(jaxdet.matmul(v, W) ** 2))(b)}

    assert_batch_invariant(rows_and_grad, X, sizes=(1, 16))


def test_jnp_dot_float32_is_not_batch_invariant_on_cpu(cpu):
    with jax.default_device(cpu), pytest.raises(AssertionError) as err:
        assert_batch_invariant(lambda b: jnp.dot(b, W), X, what="jnp.dot")
    msg = str(err.value)
    assert msg.startswith("jnp.dot is not batch invariant: row 0's outputs changed in ")
    assert "differ bitwise; first: (" in msg and "ulp]" in msg and "largest |difference|" in msg


def test_failure_lists_every_size_and_position_and_output_path():
    def leaky(b):  # row 0 depends on the other rows: never batch invariant
        return {"y": b - b.mean(0), "z": b[:, :3]}

    with pytest.raises(AssertionError) as err:
        assert_batch_invariant(leaky, X[:8], sizes=(1, 2, 5), positions=(0, 4))
    msg = str(err.value)
    assert (
        "changed in 3 case(s) (size 2 position 0 output['y'], size 5 position 0 output['y'], size 5 position 4 "
        "output['y'])" in msg
    )
    assert "First: leaky: output['y'], row 0 at position 0 of a batch of 2 vs alone: 1024 of 1024 elements" in msg


def test_rows_are_placed_where_asked_and_batches_are_filled_by_cycling():
    seen = []

    def record(b):
        seen.append(np.asarray(b[:, 0]))
        return b * 2

    batch = jnp.arange(3.0)[:, None] * jnp.ones((3, 2))
    assert_batch_invariant(record, batch, sizes=(5,), positions=(2,), row=1, jit=False)
    np.testing.assert_array_equal(seen[0], [1.0])  # the row alone
    np.testing.assert_array_equal(seen[1], [0.0, 2.0, 1.0, 0.0, 2.0])  # row 1 at position 2, others cycled


def test_per_example_keys_are_rows_too():
    keys = jax.random.split(jax.random.key(0), 8)

    def noisy(batch):
        x, k = batch
        return x + jax.vmap(lambda k: jax.random.normal(k, (4,)))(k)

    assert_batch_invariant(noisy, (jnp.ones((8, 4)), keys), sizes=(1, 3, 8))
    dkeys = jax.vmap(lambda i: jaxdet.random.fold_in(jaxdet.random.key(0), i))(jnp.arange(8))
    assert_batch_invariant(lambda b: jax.vmap(lambda x, k: jaxdet.dropout(x, k, 0.5))(*b), (X[:8], dkeys), sizes=(1, 8))


def test_outputs_without_a_row_axis_are_refused():
    with pytest.raises(ValueError, match=r"output has shape \[\], but a batch of 1 rows needs outputs with a leading"):
        assert_batch_invariant(lambda b: jnp.sum(b), X)


def test_bad_arguments():
    with pytest.raises(ValueError, match="leading"):
        assert_batch_invariant(lambda b: b, {"a": jnp.ones((3, 2)), "b": jnp.ones((4, 2))})
    with pytest.raises(ValueError, match="leading"):
        assert_batch_invariant(lambda b: b, jnp.float32(1.0))
    with pytest.raises(TypeError, match="sizes"):
        assert_batch_invariant(lambda b: b, X, sizes=4)
    with pytest.raises(ValueError, match="sizes"):
        assert_batch_invariant(lambda b: b, X, sizes=(0, 4))
    with pytest.raises(TypeError, match="positions"):
        assert_batch_invariant(lambda b: b, X, positions=1)
    with pytest.raises(ValueError, match="row must index"):
        assert_batch_invariant(lambda b: b, X, row=64)


# ---- assert_deterministic. ----


def test_deterministic_functions_pass_with_and_without_recompiling():
    assert_deterministic(lambda a, b: jnp.dot(a, b), X, W)
    assert_deterministic(lambda a, b: jaxdet.matmul(a, b), X, W, runs=2, recompile=True)


def test_a_nondeterministic_function_fails_with_the_run_and_bits():
    counter = itertools.count()

    def drifting(x):
        noise = jax.pure_callback(
            lambda: np.float32(next(counter)) * np.float32(1e-3), jax.ShapeDtypeStruct((), jnp.float32)
        )
        return {"y": x + noise}

    with pytest.raises(AssertionError) as err:
        assert_deterministic(drifting, jnp.ones(4), runs=3)
    msg = str(err.value)
    assert msg.startswith("drifting is not deterministic over 3 runs: 2 output(s) differ.")
    assert "First: drifting: output['y'], run 2 vs run 1: 4 of 4 elements differ bitwise; first: (0,): 1.001" in msg
    with pytest.raises(ValueError, match="runs must be an int >= 2"):
        assert_deterministic(drifting, jnp.ones(4), runs=1)


# ---- Pytrees and Flax nnx modules. ----


def test_bit_comparisons_take_pytrees_leaf_by_leaf():
    a = {"params": {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}, "step": (jnp.int32(4),)}
    b = jax.tree.map(lambda x: x, a)
    b["params"]["w"] = b["params"]["w"].at[1, 2].set(2.0)
    assert same_bits(a, jax.tree.map(lambda x: x, a)) and not same_bits(a, b)
    assert count_bit_differences(a, b) == 1
    assert describe_bit_differences(a, jax.tree.map(lambda x: x, a), "state") is None
    msg = describe_bit_differences(a, b, "state")
    assert msg.startswith("state: 1 of 3 leaves differ\nstate['params']['w']: 1 of 6 elements differ bitwise")
    with pytest.raises(AssertionError, match=r"state\['params'\]\['w'\]: 1 of 6 elements differ"):
        assert_bitwise_equal(a, b, "state")
    assert_bitwise_equal((X, [W]), (X, [W]))
    assert not same_bits(a, {"params": a["params"]})  # another structure
    with pytest.raises(AssertionError, match="cannot compare pytrees of different structures"):
        assert_bitwise_equal(a, {"params": a["params"]})
    with pytest.raises(ValueError, match="different structures"):
        count_bit_differences([X], [X, X])
    with pytest.raises(TypeError, match=r"bits takes one array, got a pytree \(dict\)"):
        bits(a)
    assert count_bit_differences([1.0, 2.0], [1.0, 3.0]) == 1  # a list of numbers is still one array


def _nnx_model():
    nnx = pytest.importorskip("flax.nnx")

    class Noisy(nnx.Module):
        """A linear layer that draws a key and counts its calls on every call (nnx state it mutates),
        its outputs depending on neither."""

        def __init__(self):
            self.linear = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
            self.rngs = nnx.Rngs(1)
            self.calls = nnx.Variable(jnp.int32(0))

        def __call__(self, x):
            key = self.rngs()
            self.calls.value += 1
            return jaxdet.matmul(x, self.linear.kernel.value) + 0.0 * jax.random.uniform(key, ())

    return nnx, Noisy()


def test_helpers_run_flax_nnx_closures_and_modules_under_jit():
    """jax.jit of a closure over an nnx Module that mutates its state fails (TraceContextError); the
    helpers run it through nnx.jit and leave the module's state as it was."""
    nnx, model = _nnx_model()
    x = jax.random.normal(jax.random.key(2), (16, 8), jnp.float32)
    count = int(model.rngs.default.count.value)
    assert_deterministic(lambda b: model(b), x, runs=3)
    assert_deterministic(lambda b: model(b), x, runs=2, recompile=True)
    assert_deterministic(model, x)  # the module itself
    assert_deterministic(model.__call__, x)  # a bound method
    assert_deterministic(lambda m, b: m(b), model, x)  # the module as an argument
    assert_batch_invariant(lambda b: model(b), x, sizes=(1, 4))
    assert_batch_invariant(lambda b: model(b), x, sizes=(4,), jit=False)
    assert int(model.calls.value) == 0 and int(model.rngs.default.count.value) == count  # as it was


def test_nnx_state_the_helpers_cannot_reach_is_a_clear_error():
    _, model = _nnx_model()
    holder = {"model": model}  # reached through a dict: not found

    def fn(b):
        return holder["model"](b)

    with pytest.raises(TypeError, match="pass the module as an argument"):
        assert_deterministic(fn, jnp.ones((4, 8)))


def test_assert_deterministic_compares_what_an_nnx_step_changes_in_place():
    """Only the loss is returned; the parameter the step writes differs between compilations (a
    trace-time constant drawn anew), and the helper sees it."""
    nnx = pytest.importorskip("flax.nnx")
    draws = iter(np.arange(1.0, 10.0))

    class Model(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.zeros(3))

    def step(model):
        model.w[...] = model.w[...] + next(draws)  # a new constant every trace
        return jnp.float32(0.0)

    model = Model()
    jaxdet.testing.assert_deterministic(step, model)  # one executable: the same update every run
    with pytest.raises(AssertionError, match="run 2 vs run 1"):
        jaxdet.testing.assert_deterministic(step, model, recompile=True)
    np.testing.assert_array_equal(model.w[...], np.zeros(3))  # the helper leaves the model as it was
