# Copyright 2024 The Flax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Source: flax v0.12.8 (github.com/google/flax, commit 3a49110824001614baf35c6ee8934479fcdb133a):
# tests/nnx/nn/linear_test.py, tests/nnx/nn/embed_test.py, tests/nnx/nn/normalization_test.py,
# tests/nnx/nn/stochastic_test.py and tests/linen/linen_test.py (StochasticTest); each class below
# names its file. Reformatted by ruff; what else was changed says so where it was changed.
"""Flax's own tests of Linear, Embed, LayerNorm / RMSNorm (with ``mask=``) and Dropout, run against
the ``jaxdet.nnx`` drop-ins.

The tests read their classes from ``nnx``, which here is flax's ``flax.nnx`` with ``Linear``,
``Embed``, ``LayerNorm``, ``RMSNorm`` and ``Dropout`` replaced by ``jaxdet.nnx``'s. Flax's tests
compare the NNX module against linen's with ``assert_array_equal``; jaxdet adds in its own
canonical order, not XLA's, so those comparisons allow rounding (``assert_equal_to_rounding``).
"""

import types
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("absl.testing.absltest")

from absl.testing import parameterized  # noqa: E402
from flax import linen  # noqa: E402
from flax import nnx as flax_nnx  # noqa: E402
from flax.typing import Dtype, PrecisionLike  # noqa: E402
from jax import random  # noqa: E402
from jax.lax import Precision  # noqa: E402

import jaxdet.nnx  # noqa: E402

DROP_INS = ("Linear", "Embed", "LayerNorm", "RMSNorm", "Dropout")
nnx = types.SimpleNamespace(**{**vars(flax_nnx), **{name: getattr(jaxdet.nnx, name) for name in DROP_INS}})


def test_the_substituted_namespace_holds_the_drop_ins():
    for name in DROP_INS:
        cls = getattr(nnx, name)
        assert cls is getattr(jaxdet.nnx, name) and issubclass(cls, getattr(flax_nnx, name))


def assert_equal_to_rounding(expected, actual):
    """Adapted from ``np.testing.assert_array_equal``: flax's linen module and the drop-in add the same
    terms in different orders, so they agree to a few units of the result dtype's rounding."""
    expected, actual = np.asarray(expected), np.asarray(actual)
    assert expected.shape == actual.shape and expected.dtype == actual.dtype, (expected.dtype, actual.dtype)
    eps = float(jnp.finfo(expected.dtype).eps)
    scale = float(np.max(np.abs(expected.astype(np.float64)))) if expected.size else 0.0
    np.testing.assert_allclose(
        actual.astype(np.float64), expected.astype(np.float64), rtol=8 * eps, atol=8 * eps * scale
    )


# ---- tests/nnx/nn/linear_test.py ----


class TestLinenConsistency(parameterized.TestCase):
    @parameterized.product(
        use_bias=[True, False],
        dtype=[jnp.float32, jnp.float16],
        param_dtype=[jnp.float32, jnp.float16],
        precision=[Precision.DEFAULT, Precision.HIGH, Precision.HIGHEST],
        preferred_element_type=[None, jnp.float32],
    )
    def test_nnx_linear_equivalence(
        self,
        use_bias: bool,
        dtype: Dtype | None,
        param_dtype: Dtype,
        precision: PrecisionLike,
        preferred_element_type: Dtype | None,
    ):
        key = jax.random.key(42)
        rngs = nnx.Rngs(42)
        IN_FEATURES = 32
        OUT_FEATURES = 64

        x = jax.numpy.ones((1, IN_FEATURES))
        model_nnx = nnx.eval_shape(
            lambda rngs: nnx.Linear(
                IN_FEATURES,
                OUT_FEATURES,
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                precision=precision,
                preferred_element_type=preferred_element_type,
                rngs=rngs,
            ),
            rngs,
        )
        if preferred_element_type is not None:
            dot_general = partial(
                jax.lax.dot_general,
                preferred_element_type=preferred_element_type,
            )
        else:
            dot_general = None
        model = linen.Dense(
            OUT_FEATURES,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            precision=precision,
            dot_general=dot_general,
        )
        variables = model.init(key, x)
        model_nnx.kernel.set_value(variables["params"]["kernel"])
        if use_bias:
            model_nnx.bias.set_value(variables["params"]["bias"])

        out_nnx = model_nnx(x)
        out = model.apply(variables, x)
        assert isinstance(out, jax.Array)
        # Adapted: assert_array_equal -> assert_equal_to_rounding (module docstring).
        assert_equal_to_rounding(out, out_nnx)


class TestLayersSameGraph(parameterized.TestCase):
    # Adapted: the list keeps flax's entries for the drop-ins only (the other modules are flax's own).
    @parameterized.product(
        module_args_kwargs_initargs=[
            (nnx.Linear, (2, 4), ("kernel_init", "bias_init")),
            (nnx.Embed, (2, 4), ("embedding_init",)),
            (nnx.LayerNorm, (3,), ("scale_init", "bias_init")),
            (nnx.RMSNorm, (3,), ("scale_init",)),
        ],
    )
    def test(self, module_args_kwargs_initargs):
        module_cls, args, init_argnames = module_args_kwargs_initargs
        kwargs = {"rngs": nnx.Rngs(0)}
        init_zeros = nnx.initializers.zeros
        init_ones = nnx.initializers.ones
        init1_kwargs = {k: init_zeros for k in init_argnames}
        init2_kwargs = {k: init_ones for k in init_argnames}
        mod1 = module_cls(*args, **init1_kwargs, **kwargs)
        mod2 = module_cls(*args, **init2_kwargs, **kwargs)
        g1, g2 = nnx.graphdef(mod1), nnx.graphdef(mod2)
        assert g1 == g2


class TestLayersParamsMetadata(parameterized.TestCase):
    # Adapted: the list keeps flax's entries for the drop-ins only.
    @parameterized.product(
        module_args_kwargs_initargs=[
            (nnx.Linear, (2, 4), (("kernel", 2, ()), ("bias", 1, ()))),
            (nnx.Embed, (2, 4), (("embedding", 2, ()),)),
            (nnx.LayerNorm, (3,), (("scale", 1, ()), ("bias", 1, ()))),
            (nnx.RMSNorm, (3,), (("scale", 1, ()),)),
        ],
    )
    def test(self, module_args_kwargs_initargs):
        module_cls, args, metadata_argnames = module_args_kwargs_initargs
        kwargs = {"rngs": nnx.Rngs(0)}
        out_sharding = ("din", "dout")
        metadata_kwargs = {f"{key}_metadata": {"out_sharding": out_sharding[:le]} for key, le, _ in metadata_argnames}

        mesh = jax.make_mesh(
            (1, 1),
            out_sharding,
            axis_types=(jax.sharding.AxisType.Auto,) * len(out_sharding),
        )
        with jax.set_mesh(mesh):
            module = module_cls(*args, **metadata_kwargs, **kwargs)

        for key, le, attrs in metadata_argnames:
            attrs = attrs if attrs else ((None, key),)
            for attr_name, param_name in attrs:
                attr = getattr(module, attr_name) if attr_name is not None else module
                param = getattr(attr, param_name)
                self.assertIsNotNone(param.out_sharding)
                self.assertEqual(param.out_sharding, out_sharding[:le])


# ---- tests/nnx/nn/embed_test.py ----


class TestEmbedLinenConsistency(parameterized.TestCase):  # flax's name: TestLinenConsistency
    @parameterized.product(
        input_dtype=[jnp.int16, jnp.int32],
        num_embeddings=[1, 7],
        dtype=[jnp.float32, jnp.float16],
        param_dtype=[jnp.float32, jnp.float16],
    )
    def test_nnx_linen_equivalence(
        self,
        input_dtype: Dtype | None,
        num_embeddings: int,
        dtype: Dtype | None,
        param_dtype: Dtype,
    ):
        key = jax.random.key(42)
        rngs = nnx.Rngs(42)
        IN_FEATURES = 32
        NUM_EMBEDDINGS = num_embeddings

        x = jax.numpy.arange(NUM_EMBEDDINGS, dtype=input_dtype)
        model_nnx = nnx.eval_shape(
            lambda rngs: nnx.Embed(
                NUM_EMBEDDINGS,
                IN_FEATURES,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            ),
            rngs,
        )
        model = linen.Embed(NUM_EMBEDDINGS, IN_FEATURES, dtype=dtype, param_dtype=param_dtype)
        variables = model.init(key, x)
        model_nnx.embedding.set_value(variables["params"]["embedding"])

        out_nnx = model_nnx(x)
        out = model.apply(variables, x)
        assert isinstance(out, jax.Array)
        np.testing.assert_array_equal(out, out_nnx)

        x = jax.numpy.ones((10,), dtype=input_dtype) * 10
        out_nnx = model_nnx(x)
        out = model.apply(variables, x)
        assert isinstance(out, jax.Array)
        np.testing.assert_array_equal(out, out_nnx)


# ---- tests/nnx/nn/normalization_test.py (the LayerNorm and RMSNorm cases) ----


class TestNormLinenConsistency(parameterized.TestCase):  # flax's name: TestLinenConsistency
    @parameterized.product(
        dtype=[jnp.float32, jnp.float16],
        param_dtype=[jnp.float32, jnp.float16],
        use_fast_variance=[True, False],
        mask=[None, np.array([True, False, True, False, True])],
    )
    def test_nnx_linen_layernorm_equivalence(
        self,
        dtype: Dtype | None,
        param_dtype: Dtype,
        use_fast_variance: bool,
        mask: np.ndarray | None,
    ):
        class NNXModel(nnx.Module):
            def __init__(self, dtype, param_dtype, use_fast_variance, rngs):
                self.norm_layer = nnx.LayerNorm(
                    5,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    use_fast_variance=use_fast_variance,
                    promote_dtype=lambda x, **kwargs: x,  # ensure same behavior as Linen
                    rngs=rngs,
                )
                self.linear = nnx.Linear(5, 4, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

            def __call__(self, x, *, mask=None):
                x = self.norm_layer(x, mask=mask)
                x = self.linear(x)
                return x

        class LinenModel(linen.Module):
            dtype: Dtype | None = None
            param_dtype: Dtype = jnp.float32
            use_fast_variance: bool = True

            def setup(self):
                self.norm_layer = linen.LayerNorm(
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                    use_fast_variance=self.use_fast_variance,
                )
                self.linear = linen.Dense(4, dtype=self.dtype, param_dtype=self.param_dtype)

            def __call__(self, x, *, mask=None):
                x = self.norm_layer(x, mask=mask)
                x = self.linear(x)
                return x

        rngs = nnx.Rngs(42)
        x = jax.random.normal(jax.random.key(0), (10, 5))

        linen_model = LinenModel(dtype=dtype, param_dtype=param_dtype, use_fast_variance=use_fast_variance)
        variables = linen_model.init(jax.random.key(1), x)
        linen_out = linen_model.apply(variables, x, mask=mask)
        assert isinstance(linen_out, jax.Array)

        nnx_model = NNXModel(
            dtype=dtype,
            param_dtype=param_dtype,
            use_fast_variance=use_fast_variance,
            rngs=rngs,
        )
        nnx_model.linear.kernel[...] = variables["params"]["linear"]["kernel"]
        nnx_model.linear.bias[...] = variables["params"]["linear"]["bias"]

        nnx_out = nnx_model(x, mask=mask)
        # Adapted: assert_array_equal -> assert_equal_to_rounding (module docstring).
        assert_equal_to_rounding(linen_out, nnx_out)

    @parameterized.product(
        dtype=[jnp.float32, jnp.float16],
        param_dtype=[jnp.float32, jnp.float16],
        use_fast_variance=[True, False],
        mask=[None, np.array([True, False, True, False, True])],
    )
    def test_nnx_linen_rmsnorm_equivalence(
        self,
        dtype: Dtype | None,
        param_dtype: Dtype,
        use_fast_variance: bool,
        mask: np.ndarray | None,
    ):
        class NNXModel(nnx.Module):
            def __init__(self, dtype, param_dtype, use_fast_variance, rngs):
                self.norm_layer = nnx.RMSNorm(
                    5,
                    dtype=dtype,
                    param_dtype=param_dtype,
                    use_fast_variance=use_fast_variance,
                    promote_dtype=lambda x, **kwargs: x,  # ensure same behavior as Linen
                    rngs=rngs,
                )
                self.linear = nnx.Linear(5, 4, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

            def __call__(self, x, *, mask=None):
                x = self.norm_layer(x, mask=mask)
                x = self.linear(x)
                return x

        class LinenModel(linen.Module):
            dtype: Dtype | None = None
            param_dtype: Dtype = jnp.float32
            use_fast_variance: bool = True

            def setup(self):
                self.norm_layer = linen.RMSNorm(
                    dtype=self.dtype,
                    param_dtype=self.param_dtype,
                    use_fast_variance=self.use_fast_variance,
                )
                self.linear = linen.Dense(4, dtype=self.dtype, param_dtype=self.param_dtype)

            def __call__(self, x, *, mask=None):
                x = self.norm_layer(x, mask=mask)
                x = self.linear(x)
                return x

        rngs = nnx.Rngs(42)
        x = jax.random.normal(jax.random.key(0), (10, 5))

        linen_model = LinenModel(dtype=dtype, param_dtype=param_dtype, use_fast_variance=use_fast_variance)
        variables = linen_model.init(jax.random.key(1), x)
        linen_out = linen_model.apply(variables, x, mask=mask)

        nnx_model = NNXModel(
            dtype=dtype,
            param_dtype=param_dtype,
            use_fast_variance=use_fast_variance,
            rngs=rngs,
        )
        nnx_model.linear.kernel.set_value(variables["params"]["linear"]["kernel"])
        nnx_model.linear.bias.set_value(variables["params"]["linear"]["bias"])

        nnx_out = nnx_model(x, mask=mask)
        assert isinstance(linen_out, jax.Array)
        # Adapted: assert_array_equal -> assert_equal_to_rounding (module docstring).
        assert_equal_to_rounding(linen_out, nnx_out)


# ---- tests/nnx/nn/stochastic_test.py ----


class TestStochastic:
    def test_dropout_internal_rngs(self):
        n = 0
        m1 = nnx.Dropout(rate=0.5, deterministic=False, rngs=nnx.Rngs(dropout=0))
        m2 = nnx.Dropout(rate=0.5, deterministic=False)
        rngs2 = nnx.Rngs(dropout=0).fork()

        @nnx.jit
        def f(m, x, rngs=None):
            nonlocal n
            n += 1
            return m(x, rngs=rngs)

        x = jnp.ones((1, 10))
        assert m1.rngs is not None and m1.rngs.count[...] == 0

        y1 = f(m1, x)
        assert n == 1
        assert m1.rngs.count[...] == 1
        y2 = f(m2, x, rngs=rngs2)
        assert n == 2
        assert rngs2.dropout.count[...] == 1
        np.testing.assert_allclose(y1, y2)

        y1 = f(m1, x)
        assert m1.rngs.count[...] == 2
        y2 = f(m2, x, rngs=rngs2)
        assert rngs2.dropout.count[...] == 2
        np.testing.assert_allclose(y1, y2)

        assert n == 2

    def test_dropout_rng_override(self):
        m1 = nnx.Dropout(rate=0.5, deterministic=False, rngs=nnx.Rngs(dropout=0))
        m2 = nnx.Dropout(rate=0.5, deterministic=False, rngs=nnx.Rngs(dropout=1))
        x = jnp.ones((1, 10))

        y1 = m1(x)
        y2 = m2(x)
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(y1, y2)

        y2 = m2(x, rngs=nnx.Rngs(dropout=0).fork())
        np.testing.assert_allclose(y1, y2)

    def test_dropout_arg_override(self):
        m = nnx.Dropout(rate=0.5, deterministic=False)
        x = jnp.ones((1, 10))

        # deterministic call arg provided
        m(x, deterministic=True)
        # deterministic constructor arg provided
        m.set_attributes(deterministic=True)
        y = m(x)
        # both deterministic call and constructor arg provided
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(y, m(x, deterministic=False, rngs=nnx.Rngs(dropout=0)))
        # no rng arg provided
        m.set_attributes(deterministic=False)
        with pytest.raises(
            ValueError,
            match="`deterministic` is False, but no `rngs` argument was provided to Dropout",
        ):
            m(x)

    def test_dropout_arg_override_view(self):
        m = nnx.Dropout(rate=0.5, deterministic=False)
        x = jnp.ones((1, 10))

        # deterministic call arg provided
        m(x, deterministic=True)
        # deterministic constructor arg provided
        new_m = nnx.view(m, deterministic=True)
        y = new_m(x)
        # both deterministic call and constructor arg provided
        with pytest.raises(AssertionError):
            np.testing.assert_allclose(y, new_m(x, deterministic=False, rngs=nnx.Rngs(dropout=0)))
        # no rng arg provided
        new_m = nnx.view(m, deterministic=False)
        with pytest.raises(
            ValueError,
            match="`deterministic` is False, but no `rngs` argument was provided to Dropout",
        ):
            new_m(x)


# ---- tests/linen/linen_test.py (StochasticTest: rate limits incl. 1.0, statistics, broadcast_dims) ----
# Adapted throughout: linen's `nn.Dropout(...).apply({}, x, deterministic=..., rngs={'dropout': key})`
# becomes the NNX drop-in's call with the same key, `nnx.Dropout(...)(x, deterministic=..., rngs=key)`.


class StochasticTest(parameterized.TestCase):
    def test_dropout(self):
        rng = random.key(0)
        key1, key2 = random.split(rng)
        module = nnx.Dropout(rate=0.5)
        y1 = module(jnp.ones((20, 20)), deterministic=False, rngs=key1)
        y2 = module(jnp.ones((20, 20)), deterministic=False, rngs=key2)
        self.assertFalse(np.all(y1 == y2))

        y1 = module(jnp.ones((20, 20)), deterministic=True, rngs=key1)
        y2 = module(jnp.ones((20, 20)), deterministic=True, rngs=key2)
        self.assertTrue(np.all(y1 == y2))

    def test_dropout_rate_stats(self):
        rootkey = random.key(0)
        for rate in np.arange(0.1, 1.0, 0.1):
            rootkey, subkey = random.split(rootkey)
            module = nnx.Dropout(rate=rate)
            n_trials = 10
            nonzero_counts = 0
            for key in random.split(subkey, n_trials):
                y = module(jnp.ones((100, 100)), deterministic=False, rngs=key)
                nonzero_counts += np.sum(y > 0.0)
            all_counts = np.prod((100, 100, n_trials))
            frac = np.sum(nonzero_counts) / all_counts
            keep_rate = 1.0 - rate
            # just check within 4 sigma.
            delta = 4 * np.sqrt(rate * keep_rate) / np.sqrt(all_counts)
            self.assertTrue(keep_rate - delta < frac < keep_rate + delta)

    def test_dropout_rate_limits(self):
        rng = random.key(0)
        key1, key2, key3 = random.split(rng, 3)
        inputs = jnp.ones((20, 20))
        d0 = nnx.Dropout(rate=0.0)
        y1 = d0(inputs, deterministic=False, rngs=key1)
        np.testing.assert_array_equal(y1, inputs)
        d1 = nnx.Dropout(rate=1.0)
        y2 = d1(inputs, deterministic=False, rngs=key2)
        np.testing.assert_array_equal(y2, np.zeros_like(inputs))
        # ensure gradient of rate==1.0 case is non-NaN
        fn = lambda x, k: d1(x, rngs=k, deterministic=False)
        res = jax.grad(lambda x, k: jnp.sum(fn(x, k)))(inputs, key3)
        self.assertFalse(np.isnan(res).any())

    @parameterized.parameters(
        {
            "num_dims": 2,
            "broadcast_dims": (1,),
            "slice_fn": lambda out, i: out[i, :],
            "summed_total": 2 * 10,
        },
        {
            "num_dims": 2,
            "broadcast_dims": (0,),
            "slice_fn": lambda out, i: out[:, i],
            "summed_total": 2 * 10,
        },
        {
            "num_dims": 3,
            "broadcast_dims": (1, 2),
            "slice_fn": lambda out, i: out[i, :, :],
            "summed_total": 2 * 10 * 10,
        },
        {
            "num_dims": 3,
            "broadcast_dims": (1,),
            "slice_fn": lambda out, i, j: out[i, :, j],
            "summed_total": 2 * 10,
        },
        {
            "num_dims": 4,
            "broadcast_dims": (0, 2, 3),
            "slice_fn": lambda out, i: out[:, i, :, :],
            "summed_total": 2 * 10 * 10 * 10,
        },
        {
            "num_dims": 4,
            "broadcast_dims": (0, 1),
            "slice_fn": lambda out, i, j: out[:, :, i, j],
            "summed_total": 2 * 10 * 10,
        },
        {
            "num_dims": 4,
            "broadcast_dims": (3,),
            "slice_fn": lambda out, i, j, k: out[i, j, k, :],
            "summed_total": 2 * 10,
        },
    )
    def test_dropout_broadcast(self, num_dims, broadcast_dims, slice_fn, summed_total):
        module = nnx.Dropout(rate=0.5, broadcast_dims=broadcast_dims, deterministic=False)
        x = jnp.ones((10,) * num_dims)
        out = module(x, rngs=random.key(0))

        for i in range(10):
            if num_dims - len(broadcast_dims) >= 2:
                for j in range(10):
                    if num_dims - len(broadcast_dims) >= 3:
                        for k in range(10):
                            self.assertTrue(slice_fn(out, i, j, k).sum() in (0, summed_total))
                    else:
                        self.assertTrue(slice_fn(out, i, j).sum() in (0, summed_total))
            else:
                self.assertTrue(slice_fn(out, i).sum() in (0, summed_total))
