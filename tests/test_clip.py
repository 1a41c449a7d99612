"""Fused deterministic global-norm clipping: the contract of docs/clipping.md.

Semantics proven here (each test names the clause it proves):
  * norm = sqrt(sum of squares) accumulated in float32 per chunk / float64 over chunks, also for
    bfloat16 / float16 leaves; within 1e-6 relative of a float64 reference; no float16 overflow.
  * the canonical order: the norm and the clipped leaves equal, bit for bit, a NumPy
    re-implementation of the documented order (jaxdet/_src/clip/reference.py).
  * scale = min(1, max_norm / norm); norm == 0 -> scale 1; max_norm == 0 with norm == 0 -> no NaN;
    max_norm == inf never produces NaN; scale == 1 leaves every leaf bit-identical (NaN payloads,
    -0 and subnormals included).
  * nonfinite="propagate" (optax-like) and nonfinite="skip" (zero update).
  * bad input errors before anything runs; one native call; aliased outputs; no host transfers.
  * GPU (pytest -m gpu): CPU == GPU bitwise; run-to-run bitwise.
"""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from bitwise import assert_bitwise, bits

import jaxdet
from jaxdet._src.clip import contracts
from jaxdet._src.clip import primitives as _kernels
from jaxdet._src.clip import reference as ref

BF16 = jnp.bfloat16
F16 = jnp.float16
MAX_ALIASED_LEAVES = _kernels.MAX_ALIASED_LEAVES


def assert_tree_bits_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert_bitwise(x, y)


mixed_tree = contracts.mixed_tree


def np_leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def f64_norm(tree):
    return math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in np_leaves(tree)))


# ---- norm accuracy and canonical order -----------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_norm_within_1e6_of_float64_reference(seed):
    ok, detail = contracts.check_norm_accuracy(mixed_tree(seed))
    assert ok, detail


def test_norm_of_large_tree_within_1e6():
    rng = np.random.default_rng(3)
    tree = [jnp.asarray(rng.standard_normal(n).astype(np.float32)) for n in (3_000_000, 1_234_567, 77)]
    ok, detail = contracts.check_norm_accuracy(tree)
    assert ok, detail


@pytest.mark.parametrize("seed", [0, 5])
def test_norm_and_clip_bitwise_equal_canonical_numpy_order(seed):
    ok, detail = contracts.check_canonical_order(mixed_tree(seed, scale=3.0), 1.0)
    assert ok, detail


def test_subnormals_are_kept_ieee():
    # XLA's CPU runtime flushes subnormals; the clip target must not (the GPU does not).
    tiny = np.full((5000,), 3e-39, np.float32)  # squares underflow to 0, values are subnormal
    x = np.concatenate([tiny, np.full((10,), 1e-20, np.float32)])
    clipped, norm = jaxdet.clip_by_global_norm({"x": jnp.asarray(x)}, 1e-21)
    want_leaves, want_norm = ref.clip_by_global_norm([x], 1e-21)
    assert_bitwise(norm, want_norm)
    assert_bitwise(clipped["x"], want_leaves[0])
    assert np.any(np.asarray(clipped["x"])[:5000] != 0)  # scaled subnormals are not flushed


def test_float16_sum_of_squares_does_not_overflow():
    x = jnp.full((1000,), 300.0, F16)  # each square 90000 > float16 max; norm ~ 9487
    norm = float(jaxdet.global_norm([x]))
    assert math.isfinite(norm)
    assert abs(norm - 300.0 * math.sqrt(1000)) <= 1e-6 * norm
    clipped, n2 = jaxdet.clip_by_global_norm([x], 1.0)
    assert float(n2) == norm
    assert np.all(np.isfinite(np.asarray(clipped[0], np.float32)))


def test_bfloat16_norm_accumulates_in_float32():
    x = jnp.full((100_000,), 1.0, BF16)  # a bfloat16 running sum would stall at 256
    assert abs(float(jaxdet.global_norm([x])) - math.sqrt(100_000)) <= 1e-6 * math.sqrt(100_000)


def test_global_norm_equals_clip_norm_and_jit_equals_eager():
    tree = mixed_tree(7)
    _, norm = jaxdet.clip_by_global_norm(tree, 0.5)
    assert_bitwise(jaxdet.global_norm(tree), norm)
    c_jit, n_jit = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, 0.5))(tree)
    c_eager, n_eager = jaxdet.clip_by_global_norm(tree, 0.5)
    assert_bitwise(n_jit, n_eager)
    assert_tree_bits_equal(c_jit, c_eager)


def test_run_to_run_bitwise():
    ok, detail = contracts.check_run_to_run(mixed_tree(11, scale=5.0))
    assert ok, detail


def test_traced_max_norm():
    tree = mixed_tree(2, scale=2.0)
    f = jax.jit(lambda t, m: jaxdet.clip_by_global_norm(t, m))
    for m in (0.25, 1.0, 1e9):
        c_t, n_t = f(tree, jnp.float32(m))
        c, n = jaxdet.clip_by_global_norm(tree, m)
        assert_tree_bits_equal(c_t, c)
        assert_bitwise(n_t, n)
    # A negative traced max_norm acts as 0 (documented): everything becomes (signed) zero.
    c_neg, _ = f(tree, jnp.float32(-1.0))
    c_zero, _ = jaxdet.clip_by_global_norm(tree, 0.0)
    assert_tree_bits_equal(c_neg, c_zero)


def test_clipped_norm_is_max_norm():
    tree = mixed_tree(4, scale=10.0)
    clipped, norm = jaxdet.clip_by_global_norm(tree, 2.0)
    assert float(norm) > 2.0
    assert abs(f64_norm(clipped) - 2.0) < 2e-2  # bf16 / f16 storage rounding


# ---- edge cases --------------------------------------------------------------------------------


def test_scale_one_leaves_bits_identical_including_nan_payloads_and_negative_zero():
    payload_nan = np.uint32(0x7FA12345).view(np.float32)  # a signalling NaN with a payload
    x = np.array([1.5, -0.0, 0.0, 1e-40, -2.0, 3.0], np.float32)
    h = np.array([0.5, -0.0, 6e-8], np.float16)
    b = np.array([0.25, -0.0], ml_dtypes.bfloat16)
    tree = {"x": jnp.asarray(x), "h": jnp.asarray(h), "b": jnp.asarray(b)}
    clipped, norm = jaxdet.clip_by_global_norm(tree, 100.0)
    assert float(norm) < 100.0
    assert_tree_bits_equal(clipped, tree)
    # max_norm = inf never clips: even a NaN with a payload (and so a NaN norm) keeps its bits.
    x_nan = x.copy()
    x_nan[2] = payload_nan
    tree_nan = {"x": jnp.asarray(x_nan), "h": jnp.asarray(h)}
    clipped, norm = jaxdet.clip_by_global_norm(tree_nan, math.inf)
    assert math.isnan(float(norm))
    assert_tree_bits_equal(clipped, tree_nan)


def test_norm_equal_to_max_norm_is_not_clipped():
    x = jnp.asarray(np.array([3.0, 4.0], np.float32))
    clipped, norm = jaxdet.clip_by_global_norm([x], 5.0)
    assert float(norm) == 5.0
    assert_bitwise(clipped[0], x)


def test_zero_gradients():
    tree = {"a": jnp.zeros((10,)), "b": jnp.zeros((3, 3), BF16)}
    for m in (0.0, 1.0, math.inf):
        clipped, norm = jaxdet.clip_by_global_norm(tree, m)
        assert float(norm) == 0.0
        assert_tree_bits_equal(clipped, tree)  # scale 1: no NaN from 0/0


def test_max_norm_zero_with_nonzero_gradients_gives_zeros():
    tree = {"a": jnp.asarray(np.array([1.0, -2.0], np.float32))}
    clipped, norm = jaxdet.clip_by_global_norm(tree, 0.0)
    assert float(norm) == pytest.approx(math.sqrt(5))
    np.testing.assert_array_equal(bits(clipped["a"]), bits(np.array([0.0, -0.0], np.float32)))


def test_max_norm_inf_with_inf_gradient_is_not_nan():
    x = jnp.asarray(np.array([1.0, np.inf, -3.0], np.float32))
    for policy in ("propagate",):
        clipped, norm = jaxdet.clip_by_global_norm([x], math.inf, nonfinite=policy)
        assert float(norm) == math.inf
        assert_bitwise(clipped[0], x)


def test_empty_tree_and_empty_leaves():
    clipped, norm = jaxdet.clip_by_global_norm({}, 1.0)
    assert clipped == {} and float(norm) == 0.0
    assert float(jaxdet.global_norm([])) == 0.0
    tree = [jnp.zeros((0,)), jnp.zeros((2, 0), BF16)]
    clipped, norm = jaxdet.clip_by_global_norm(tree, 1.0)
    assert float(norm) == 0.0
    assert [c.shape for c in clipped] == [(0,), (2, 0)]
    assert clipped[1].dtype == BF16


def test_zero_d_leaves():
    tree = (jnp.float32(3.0), jnp.asarray(4.0, F16), None)
    clipped, norm = jaxdet.clip_by_global_norm(tree, 1.0)
    assert float(norm) == 5.0
    assert float(clipped[0]) == np.float32(np.float32(3.0) * np.float32(1.0 / 5.0))
    assert clipped[1].shape == () and clipped[1].dtype == F16 and clipped[2] is None


# ---- non-finite policy ---------------------------------------------------------------------------


def test_nonfinite_propagate_inf_is_optax_like():
    x = jnp.asarray(np.array([1.0, np.inf, -3.0], np.float32))
    (c,), norm = jaxdet.clip_by_global_norm([x], 1.0)
    assert float(norm) == math.inf
    got = np.asarray(c)
    # scale = 1 / inf = 0: finite entries become (signed) zeros, the inf becomes NaN (as optax).
    np.testing.assert_array_equal(bits(got[[0, 2]]), bits(np.array([0.0, -0.0], np.float32)))
    assert np.isnan(got[1])
    assert bits(got[1]) == 0x7FC00000  # canonical NaN


def test_nonfinite_propagate_nan_makes_everything_nan():
    x = jnp.asarray(np.array([1.0, np.nan, -3.0], np.float32))
    y = jnp.asarray(np.array([2.0], BF16))
    (cx, cy), norm = jaxdet.clip_by_global_norm([x, y], 1.0)
    assert math.isnan(float(norm))
    assert bits(norm) == 0x7FC00000
    assert np.all(bits(cx) == 0x7FC00000) and np.all(bits(cy) == 0x7FC0)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("max_norm", [1.0, math.inf])
def test_nonfinite_skip_zeroes_the_update(bad, max_norm):
    x = np.array([1.0, bad, -3.0], np.float32)
    tree = {"x": jnp.asarray(x), "y": jnp.asarray(np.array([-2.0, 5.0], np.float16))}
    clipped, norm = jaxdet.clip_by_global_norm(tree, max_norm, nonfinite="skip")
    assert not math.isfinite(float(norm))
    for leaf in jax.tree.leaves(clipped):
        assert np.all(bits(leaf) == 0)  # +0 everywhere
    # finite gradients are unaffected by the policy
    finite = {"x": jnp.asarray(np.array([1.0, 2.0], np.float32))}
    a, na = jaxdet.clip_by_global_norm(finite, 1.0, nonfinite="skip")
    b, nb = jaxdet.clip_by_global_norm(finite, 1.0, nonfinite="propagate")
    assert_tree_bits_equal(a, b)
    assert_bitwise(na, nb)


# ---- bad input -----------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    good = {"w": jnp.ones((3,))}
    with pytest.raises(TypeError, match=r"\['count'\].*int32"):
        jaxdet.clip_by_global_norm({"w": jnp.ones((3,)), "count": jnp.zeros((), jnp.int32)}, 1.0)
    with pytest.raises(TypeError, match="leaf"):
        jaxdet.global_norm([jnp.ones((2,)), 3.0])
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        jaxdet.clip_by_global_norm(good, -1.0)
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        jaxdet.clip_by_global_norm(good, float("nan"))
    with pytest.raises(ValueError, match="scalar"):
        jaxdet.clip_by_global_norm(good, jnp.ones((2,)))
    with pytest.raises(ValueError, match="scalar"):
        jax.jit(lambda g, m: jaxdet.clip_by_global_norm(g, m))(good, jnp.ones((2,)))
    with pytest.raises(TypeError, match="max_norm"):
        jaxdet.clip_by_global_norm(good, "1.0")
    with pytest.raises(TypeError, match="max_norm"):
        jaxdet.clip_by_global_norm(good, True)
    with pytest.raises(ValueError, match="nonfinite"):
        jaxdet.clip_by_global_norm(good, 1.0, nonfinite="zero_nans")
    with pytest.raises(TypeError, match="nonfinite"):
        jaxdet.clip_by_global_norm(good, 1.0, nonfinite=None)
    if jax.config.jax_enable_x64:  # pragma: no cover
        return
    with pytest.raises(TypeError, match="float64"):
        jaxdet.global_norm([np.ones((2,), np.float64)])


def test_bad_leaves_name_the_leaf_and_the_expected_form():
    good = jnp.ones((3,))
    with pytest.raises(TypeError, match=r"leaf \['key'\].*key.*float32, bfloat16 or float16 array"):
        jaxdet.clip_by_global_norm({"w": good, "key": jax.random.key(0)}, 1.0)
    with pytest.raises(TypeError, match=r"leaf \['s'\] is a jax.ShapeDtypeStruct.*float32, bfloat16 or float16 array"):
        jaxdet.clip_by_global_norm({"w": good, "s": jax.ShapeDtypeStruct((3,), jnp.float32)}, 1.0)
    with pytest.raises(TypeError, match=r"leaf \[1\] is a jax.ShapeDtypeStruct"):
        jaxdet.global_norm([good, jax.ShapeDtypeStruct((3,), jnp.float32)])
    # Shapes go through jax.eval_shape, as for any JAX function.
    out = jax.eval_shape(lambda t: jaxdet.clip_by_global_norm(t, 1.0), {"w": jax.ShapeDtypeStruct((3,), BF16)})
    assert out[0]["w"].shape == (3,) and out[0]["w"].dtype == BF16 and out[1].dtype == jnp.float32


def test_max_norm_device_array_is_checked_like_a_number():
    good = {"w": jnp.ones((3,))}
    for bad in (jnp.float32(np.nan), jnp.float32(-1.0), jnp.asarray(np.nan, BF16)):
        with pytest.raises(ValueError, match="max_norm must be >= 0"):
            jaxdet.clip_by_global_norm(good, bad)
    with pytest.raises(ValueError, match="max_norm must be >= 0"):
        jaxdet.optax.clip_by_global_norm(jnp.float32(np.nan))
    c_dev, n_dev = jaxdet.clip_by_global_norm(good, jnp.float32(0.5))
    c, n = jaxdet.clip_by_global_norm(good, 0.5)
    assert_tree_bits_equal(c_dev, c)
    assert_bitwise(n_dev, n)


def test_traced_nan_max_norm_makes_every_leaf_nan():
    # A traced max_norm is not read back before the kernel runs (no host sync); a NaN one gives a
    # NaN scale (documented), so the mistake shows in every leaf rather than passing unnoticed.
    tree = {"w": jnp.ones((3,)), "b": jnp.full((2,), 5.0, BF16)}
    clipped, norm = jax.jit(lambda t, m: jaxdet.clip_by_global_norm(t, m))(tree, jnp.float32(np.nan))
    assert math.isfinite(float(norm))
    assert np.all(bits(clipped["w"]) == 0x7FC00000) and np.all(bits(clipped["b"]) == 0x7FC0)


# ---- compiled-step properties --------------------------------------------------------------------


def test_one_native_call_with_aliased_outputs():
    ok, detail = contracts.check_one_call_aliased(mixed_tree(1))
    assert ok, detail


def test_clip_inside_jit_needs_no_copy_of_intermediate_gradients():
    # Gradients produced inside the step are dead after clipping: XLA aliases them in place, so the
    # compiled step has no copy instruction of its own (a copy fused into the producer is just the
    # producer writing its output).
    def step(p):
        g = jax.tree.map(lambda x: x * 2.0, p)
        return jaxdet.clip_by_global_norm(g, 1.0)

    p = {"a": jnp.ones((5000,)), "b": jnp.ones((7,), BF16)}
    hlo = jax.jit(step).lower(p).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    assert "output_to_operand_aliasing" in entry
    assert " copy(" not in entry and "copy-start" not in entry
    # Donated gradients are clipped in place too.
    hlo = jax.jit(lambda g: jaxdet.clip_by_global_norm(g, 1e-3), donate_argnums=0).lower(p).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    assert " copy(" not in entry and "copy-start" not in entry


def _many_leaves(n, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 3 * 4096, n)
    return [
        jnp.asarray(rng.standard_normal(int(k)).astype(np.float32)).astype((jnp.float32, BF16, F16)[i % 3])
        for i, k in enumerate(sizes)
    ]


@pytest.mark.parametrize("max_norm", [1.0, 1e9])
def test_staged_path_for_many_leaves_bitwise_equals_canonical_order(max_norm):
    n = 2 * MAX_ALIASED_LEAVES + 37  # three groups of aliased calls
    tree = _many_leaves(n, seed=3)
    clipped, norm = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, max_norm))(tree)
    want_leaves, want_norm = ref.clip_by_global_norm(np_leaves(tree), max_norm)
    assert_bitwise(norm, want_norm)
    assert_bitwise(jax.jit(jaxdet.global_norm)(tree), want_norm)
    for got, want in zip(clipped, want_leaves):
        assert_bitwise(got, want)
    # The fused call and the stages give the same bits on a tree both can take.
    small = tree[:MAX_ALIASED_LEAVES]
    fused = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, max_norm))(small)
    staged = jax.jit(lambda t: _kernels.staged_clip(t, jnp.float32(max_norm), 0))(small)
    assert_bitwise(fused[1], staged[0])
    assert_tree_bits_equal(fused[0], staged[1])


def test_staged_calls_alias_every_leaf_in_groups():
    n = 2 * MAX_ALIASED_LEAVES + 1
    text = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, 1.0)).lower([jnp.ones((5,))] * n).as_text()
    assert text.count("jaxdet_clip_global_norm") == 0
    assert text.count("custom_call @jaxdet_clip_partials") == 3 and text.count("custom_call @jaxdet_clip_apply") == 3
    assert text.count("custom_call @jaxdet_clip_finalize") == 1
    # Each leaf is aliased twice: handed on by its partials call, clipped in place by its apply call.
    assert text.count("output_operand_alias<") == 2 * n


@pytest.mark.parametrize("n", [64, 2 * MAX_ALIASED_LEAVES + 88])
def test_clipping_in_a_donated_step_needs_no_gradient_sized_buffer(n):
    # Fused and staged: XLA's buffer assignment for a train step whose parameters are donated. The
    # gradients are the only gradient-sized temporaries: clipping (in place) adds none and copies
    # nothing. Without the aliasing the clipped leaves would be a second set (measured in
    # docs/clipping.md).
    size = 8192
    params = [jnp.ones((size,), jnp.float32) for _ in range(n)]

    def step(p):
        g = jax.grad(lambda p: sum(jnp.sum(jnp.sin(x)) for x in p))(p)
        g, norm = jaxdet.clip_by_global_norm(g, 1.0)
        return [a - 0.1 * b for a, b in zip(p, g)], norm

    compiled = jax.jit(step, donate_argnums=0).lower(params).compile()
    grads = n * size * 4
    assert compiled.memory_analysis().temp_size_in_bytes <= grads + 64 * 1024
    entry = compiled.as_text()
    entry = entry[entry.index("\nENTRY") :]
    assert " copy(" not in entry and "copy-start" not in entry


def test_ten_thousand_leaves_compile_and_run_in_bounded_time():
    # Each native call aliases at most MAX_ALIASED_LEAVES leaves: the time XLA's fusion pass spends
    # on aliased operands grows as their count cubed per call (2000 leaves in one call took 15 s).
    # What is left grows as for any jit with that many outputs (docs/clipping.md has figures). The
    # gradients are donated, as in a train step (a non-donated argument is copied first).
    import time  # noqa: PLC0415

    n = 10_000
    rng = np.random.default_rng(7)
    tree = [jnp.asarray(rng.standard_normal(int(k)).astype(np.float32)) for k in rng.integers(1, 40, n)]
    want_leaves, want_norm = ref.clip_by_global_norm(np_leaves(tree), 1.0)
    start = time.perf_counter()
    clipped, norm = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, 1.0), donate_argnums=0)(tree)
    jax.block_until_ready(norm)
    seconds = time.perf_counter() - start
    print(f"jit(clip_by_global_norm) of {n} leaves: compile + run {seconds:.1f} s")
    assert seconds < 60.0
    assert_bitwise(norm, want_norm)
    for got, want in zip(clipped, want_leaves):
        assert_bitwise(got, want)


# ---- vmap: per-example clipping -----------------------------------------------------------------


def _per_example_tree(batch, seed=0):
    rng = np.random.default_rng(seed)

    def r(shape, dtype, scale=1.0):
        return jnp.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)

    return {
        "w": r((batch, 70, 130), jnp.float32, 3.0),  # 2 chunks + tail per example
        "b": r((5, batch), BF16),  # batch dim not leading
        "s": r((batch,), F16),  # 0-d per example
        "e": r((batch, 0), jnp.float32),  # empty per example
    }


IN_AXES = ({"w": 0, "b": 1, "s": 0, "e": 0},)


def _example(tree, i):
    return {"w": tree["w"][i], "b": tree["b"][:, i], "s": tree["s"][i], "e": tree["e"][i]}


@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_vmap_clips_each_example_bitwise_as_alone(policy):
    batch = 6
    tree = _per_example_tree(batch)
    tree["w"] = tree["w"].at[4, 0, 0].set(np.inf)  # one example with a non-finite norm
    clipped, norms = jax.jit(jax.vmap(lambda t: jaxdet.clip_by_global_norm(t, 2.0, nonfinite=policy), in_axes=IN_AXES))(
        tree
    )
    norms_only = jax.vmap(jaxdet.global_norm, in_axes=IN_AXES)(tree)
    for i in range(batch):
        c, n = jaxdet.clip_by_global_norm(_example(tree, i), 2.0, nonfinite=policy)
        assert_bitwise(norms[i], n)
        assert_bitwise(norms_only[i], n)
        for key in c:
            assert_bitwise(clipped[key][i], c[key])
    assert not math.isfinite(float(norms[4]))


def test_vmap_per_example_max_norm_unbatched_leaves_and_nesting():
    batch = 4
    tree = _per_example_tree(batch, seed=1)
    max_norms = jnp.asarray([0.0, 0.5, 30.0, np.inf], jnp.float32)
    shared = jnp.asarray(np.linspace(-1, 1, 9000, dtype=np.float32))  # one leaf for every example
    f = jax.vmap(lambda w, m, s: jaxdet.clip_by_global_norm({"w": w, "shared": s}, m), in_axes=(0, 0, None))
    clipped, norms = f(tree["w"], max_norms, shared)
    for i in range(batch):
        c, n = jaxdet.clip_by_global_norm({"w": tree["w"][i], "shared": shared}, max_norms[i])
        assert_bitwise(norms[i], n)
        assert_bitwise(clipped["w"][i], c["w"])
        assert_bitwise(clipped["shared"][i], c["shared"])
    # vmap of vmap, and vmap of a jitted function (the primitive inside the jaxpr gets batched).
    x = tree["w"].reshape(2, 2, 70, 130)
    nested = jax.vmap(jax.vmap(jax.jit(lambda t: jaxdet.clip_by_global_norm([t, t[:3]], 1.0))))(x)
    for i in range(2):
        for j in range(2):
            (c0, c1), n = jaxdet.clip_by_global_norm([x[i, j], x[i, j, :3]], 1.0)
            assert_bitwise(nested[1][i, j], n)
            assert_bitwise(nested[0][0][i, j], c0)
            assert_bitwise(nested[0][1][i, j], c1)


def test_vmap_over_many_leaves_and_empty_batch():
    leaves = [jnp.stack([x, -2.0 * x]) for x in _many_leaves(MAX_ALIASED_LEAVES + 3, seed=9)]
    clipped, norms = jax.vmap(lambda t: jaxdet.clip_by_global_norm(t, 1.0))(leaves)
    for i in range(2):
        c, n = jaxdet.clip_by_global_norm([x[i] for x in leaves], 1.0)
        assert_bitwise(norms[i], n)
        for got, want in zip(clipped, c):
            assert_bitwise(got[i], want)
    empty = jax.vmap(lambda t: jaxdet.clip_by_global_norm(t, 1.0))([jnp.ones((0, 5))])
    assert empty[0][0].shape == (0, 5) and empty[1].shape == (0,)


def _mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    out = (h @ params["w2"].astype(jnp.float32)) + params["b2"]
    return jnp.mean((out - y) ** 2)


def _mlp_init():
    rng = np.random.default_rng(0)
    return {
        "w1": jnp.asarray(rng.standard_normal((8, 16)).astype(np.float32)),
        "b1": jnp.zeros((16,)),
        "w2": jnp.asarray(rng.standard_normal((16, 4)).astype(np.float32)).astype(BF16),
        "b2": jnp.zeros((4,)),
    }


def test_jitted_train_step_under_transfer_guard_disallow():
    optax = pytest.importorskip("optax")
    params = _mlp_init()
    tx = optax.chain(jaxdet.optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, 8)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((32, 4)).astype(np.float32))
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
        clipped, norm = jaxdet.clip_by_global_norm(grads, 1.0)
        updates, opt_state = tx.update(clipped, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, norm

    step(params, opt_state, x, y)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        for _ in range(3):
            params, opt_state, loss, norm = step(params, opt_state, x, y)
    assert math.isfinite(float(loss)) and float(norm) > 0
    assert float(jaxdet.optax.last_norm(opt_state)) > 0


# ---- optax drop-in -----------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 1e6])
def test_optax_drop_in_matches_optax(max_norm):
    optax = pytest.importorskip("optax")
    params = _mlp_init()
    params = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((32, 8)).astype(np.float32))
    y = jnp.asarray(rng.standard_normal((32, 4)).astype(np.float32))
    grads = jax.grad(_mlp_loss)(params, x, y)
    ours = optax.chain(jaxdet.optax.clip_by_global_norm(max_norm), optax.sgd(0.1))
    theirs = optax.chain(optax.clip_by_global_norm(max_norm), optax.sgd(0.1))
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for _ in range(2):
        u_ours, s_ours = jax.jit(ours.update)(grads, s_ours, params)
        u_theirs, s_theirs = jax.jit(theirs.update)(grads, s_theirs, params)
        for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-9)
    norm = jaxdet.optax.last_norm(s_ours)
    assert_bitwise(norm, jaxdet.global_norm(grads))
    assert abs(float(norm) - float(optax.tree.norm(grads))) <= 1e-6 * float(norm)


def test_optax_drop_in_state_and_skip():
    optax = pytest.importorskip("optax")
    tx = jaxdet.optax.clip_by_global_norm(1.0, nonfinite="skip")
    g = {"a": jnp.asarray(np.array([3.0, 4.0], np.float32))}
    state = tx.init(g)
    assert float(state.norm) == 0.0 and int(state.num_nonfinite) == 0
    u, state = tx.update(g, state)
    assert float(state.norm) == 5.0
    np.testing.assert_allclose(np.asarray(u["a"]), [0.6, 0.8], rtol=1e-6)
    bad = {"a": jnp.asarray(np.array([np.nan, 4.0], np.float32))}
    u, state = tx.update(bad, state)
    assert np.all(bits(u["a"]) == 0) and int(state.num_nonfinite) == 1
    with pytest.raises(ValueError):
        jaxdet.optax.clip_by_global_norm(-1.0)
    with pytest.raises(ValueError):
        jaxdet.optax.clip_by_global_norm(1.0, nonfinite="nope")
    assert isinstance(tx, optax.GradientTransformation)
    # state=None, as optax allows for a transform without state: the state counts from this update.
    u, fresh = tx.update(bad, None)
    assert np.all(bits(u["a"]) == 0) and int(fresh.num_nonfinite) == 1
    u, fresh = jax.jit(tx.update)(g, None)
    assert float(fresh.norm) == 5.0 and int(fresh.num_nonfinite) == 0


# ---- GPU: CPU == GPU bitwise ----------------------------------------------------------------------


def _on(tree, device):
    return jax.device_put(tree, device)


def _gpu_trees():
    rng = np.random.default_rng(123)
    payload_nan = np.uint32(0x7FA12345).view(np.float32)
    many = [
        jnp.asarray(rng.standard_normal(int(n)).astype(np.float32)).astype(dt)
        for n, dt in zip(rng.integers(0, 20000, 1100), [jnp.float32, BF16, F16] * 400)
    ]
    sub = np.concatenate([np.full((5000,), 3e-39, np.float32), np.full((10,), 1e-20, np.float32)])
    return [
        ("mixed", mixed_tree(0, scale=3.0), 1.0),
        ("mixed_noclip", mixed_tree(1), 1e9),
        ("many_leaves", many, 10.0),  # > 1024 leaves: several launches of pass 1 and pass 3
        ("subnormal", [jnp.asarray(sub)], 1e-21),
        ("inf", [jnp.asarray(np.array([1.0, np.inf, -3.0], np.float32))], 1.0),
        ("nan", [jnp.asarray(np.array([1.0, payload_nan, -3.0], np.float32)), jnp.ones((3,), BF16)], 1.0),
        ("f16_big", [jnp.full((100_000,), 300.0, F16)], 1.0),
        ("unaligned_tail", [jnp.asarray(rng.standard_normal((4097,)).astype(np.float32))], 0.5),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_cpu_equals_gpu_bitwise(cpu, gpu, policy):
    for name, tree, max_norm in _gpu_trees():
        ok, detail = contracts.check_cpu_equals_device(tree, max_norm, policy, device=gpu)
        assert ok, f"{name}: {detail}"


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["propagate", "skip"])
def test_staged_targets_cpu_equals_gpu_bitwise(cpu, gpu, policy):
    # The three stages on their own (the path of vmap, shard_map and sharded jit, and of trees of
    # more than MAX_ALIASED_LEAVES leaves): CPU == GPU, and == the fused call.
    code = jaxdet.clip_by_global_norm.NONFINITE_POLICIES[policy]
    for name, tree, max_norm in _gpu_trees():
        leaves = jax.tree.leaves(tree)
        staged = jax.jit(lambda t: _kernels.staged_clip(t, jnp.float32(max_norm), code))
        n_cpu, c_cpu = staged(_on(leaves, cpu))
        n_gpu, c_gpu = staged(_on(leaves, gpu))
        assert_bitwise(n_cpu, n_gpu, name)
        assert_tree_bits_equal(c_cpu, c_gpu)
        fused, fused_norm = jaxdet.clip_by_global_norm(
            _on(leaves[:MAX_ALIASED_LEAVES], gpu), max_norm, nonfinite=policy
        )
        n_part, c_part = staged(_on(leaves[:MAX_ALIASED_LEAVES], gpu))
        assert_bitwise(n_part, fused_norm, name)
        assert_tree_bits_equal(c_part, fused)
        assert_bitwise(jax.jit(lambda t: _kernels.staged_norm(t))(_on(leaves, gpu)), n_cpu, name)


@pytest.mark.gpu
def test_gpu_vmap_per_example_equals_cpu(cpu, gpu):
    batch = 6
    tree = _per_example_tree(batch, seed=4)
    tree["w"] = tree["w"].at[2].multiply(1e-3).at[4, 0, 0].set(np.inf)  # an unclipped and a non-finite example
    for policy in ("propagate", "skip"):
        f = jax.jit(jax.vmap(lambda t: jaxdet.clip_by_global_norm(t, 2.0, nonfinite=policy), in_axes=IN_AXES))
        c_cpu, n_cpu = f(_on(tree, cpu))
        c_gpu, n_gpu = f(_on(tree, gpu))
        assert_bitwise(n_cpu, n_gpu)
        assert_tree_bits_equal(c_cpu, c_gpu)
    # Many leaves, per-example max_norm.
    leaves = [jnp.stack([x, -3.0 * x, 1e-3 * x]) for x in _many_leaves(MAX_ALIASED_LEAVES + 5, seed=2)]
    g = jax.jit(jax.vmap(lambda t, m: jaxdet.clip_by_global_norm(t, m)))
    m = jnp.asarray([0.5, np.inf, 4.0], jnp.float32)
    c_cpu, n_cpu = g(_on(leaves, cpu), _on(m, cpu))
    c_gpu, n_gpu = g(_on(leaves, gpu), _on(m, gpu))
    assert_bitwise(n_cpu, n_gpu)
    assert_tree_bits_equal(c_cpu, c_gpu)


@pytest.mark.gpu
def test_gpu_many_leaves_compile_and_bits(cpu, gpu):
    tree = _many_leaves(3000, seed=11)
    f = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, 1.0))
    c_cpu, n_cpu = f(_on(tree, cpu))
    c_gpu, n_gpu = f(_on(tree, gpu))
    assert_bitwise(n_cpu, n_gpu)
    assert_tree_bits_equal(c_cpu, c_gpu)


@pytest.mark.gpu
def test_gpu_matches_numpy_canonical_order(gpu):
    tree = mixed_tree(9, scale=4.0)
    clipped, norm = jaxdet.clip_by_global_norm(_on(tree, gpu), 1.0)
    want_leaves, want_norm = ref.clip_by_global_norm(np_leaves(tree), 1.0)
    assert_bitwise(norm, want_norm)
    for got, want in zip(jax.tree.leaves(clipped), want_leaves):
        assert_bitwise(got, want)


@pytest.mark.gpu
def test_gpu_run_to_run_bitwise_and_no_transfers(gpu):
    rng = np.random.default_rng(5)
    tree = _on([jnp.asarray(rng.standard_normal(n).astype(np.float32)) for n in (3_000_000, 50_000, 1)], gpu)
    f = jax.jit(lambda t: jaxdet.clip_by_global_norm(t, 1.0))
    first = f(tree)
    with jax.transfer_guard("disallow"):
        outs = [f(tree) for _ in range(5)]
    for o in outs:
        assert_tree_bits_equal(o, first)


@pytest.mark.gpu
def test_gpu_train_step_under_transfer_guard(gpu):
    optax = pytest.importorskip("optax")
    with jax.default_device(gpu):
        params = _mlp_init()
        tx = optax.chain(jaxdet.optax.clip_by_global_norm(0.1), optax.adam(1e-2))
        opt_state = tx.init(params)
        x = jnp.ones((32, 8))
        y = jnp.zeros((32, 4))

        @jax.jit
        def step(params, opt_state):
            grads = jax.grad(_mlp_loss)(params, x, y)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        step(params, opt_state)
        with jax.transfer_guard("disallow"):
            for _ in range(3):
                params, opt_state = step(params, opt_state)
        assert float(jaxdet.optax.last_norm(opt_state)) > 0
