"""jaxdet.sum / jaxdet.bias_add: the contracts of docs/reduce.md.

* the rule: bitwise the NumPy re-implementation (jaxdet/_src/reduce/reference.py), for K from 1 to
  beyond 3 chunks (where the tree is not the left fold), every axis combination of a 4-D array, all
  dtypes -- the host side of CPU == GPU; the GPU tests compare the bits;
* its consequences: an output's bits depend on its own elements only; appended zeros change no bit;
  pieces of 2^j chunks combined by tree_sum give the whole; matmul_weight_grad(x, ones) on the CPU;
* jit, vmap, grad (to second order), remat, scan, shard_map and sharded jit (8 CPU devices);
* bias_add and its gradient on 1, 2, 4, 8 devices; bad input.

Tests that need 8 devices (``on_devices``) run in a child pytest of this file with 8 simulated CPU
devices; there, the other tests are skipped (they ran here).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from checks import DTYPE_IDS, DTYPES, expect
from jax.sharding import PartitionSpec as P
from multidevice import IN_CHILD, collectives, mesh, on_devices, partitioner, put

import jaxdet
from jaxdet import parallel
from jaxdet._src.reduce import contracts
from jaxdet._src.reduce import reference as ref
from jaxdet._src.reduce.reduce import reduce_sum

C = jaxdet.sum.CHUNK_TOKENS
F32, BF16 = jnp.float32, jnp.bfloat16
NO_SUM = ("all-reduce", "reduce-scatter")


@pytest.fixture(autouse=True)
def _many_device_tests_only_in_the_child(request):
    # The 8-device child reruns this file for its `on_devices` tests only.
    child = request.config.getoption("xmlpath", None) and not request.config.pluginmanager.has_plugin("cacheprovider")
    if IN_CHILD and child and not getattr(request.function, "many_devices", False):
        pytest.skip("single-device test: runs in the parent process")


def many_devices(fn):
    fn.many_devices = True
    return on_devices(fn)


def rand(shape, dtype=F32, seed=0):
    return contracts.make_input(shape, dtype, seed=seed)


# ---- the rule: the NumPy re-implementation --------------------------------------------------------

CASES = contracts.CASES + (
    ((5,), 0),
    ((3 * C,), 0),  # 3 chunks: the tree is the left fold (p0 + p1) + p2
    ((2, 3 * C + 1, 1), 1),  # 4 chunks, the last of one element
    ((1, 2 * C, 3), (0, 1)),
    ((4, 1), -1),
)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bitwise_equal_to_the_rule(dtype):
    expect(contracts.check_reference(dtype, cases=CASES))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_every_axis_combination_of_a_4d_array(dtype):
    # Reduced axes contiguous or not, leading, middle or trailing, 1 to 4 of them; K up to 7 chunks.
    x = rand((6, 40, 5, 48), dtype, seed=1)
    xs = np.asarray(x)
    for n in range(1, 5):
        for axes in itertools.combinations(range(4), n):
            want = ref.canonical_sum(xs, axes, np.float32)
            assert_bitwise(jaxdet.sum(x, axes, dtype=F32), want, f"axes {axes} float32")
            assert_bitwise(jaxdet.sum(x, axes), ref.store(want, dtype), f"axes {axes}")
            negative = tuple(a - 4 for a in reversed(axes))  # any order, negative spellings
            assert_bitwise(jaxdet.sum(x, negative, dtype=F32), want, f"axes {negative}")


def test_out_dtype_is_the_float32_root_rounded_once():
    x = rand((7, 5 * C + 3), BF16, seed=2)
    for axis in (0, 1):
        assert_bitwise(jaxdet.sum(x, axis), jaxdet.sum(x, axis, dtype=F32).astype(BF16))
    assert jaxdet.sum(x, 1, dtype=F32).dtype == F32 and jaxdet.sum(x, 1).dtype == BF16


def test_special_values():
    # NaN (any payload) -> the canonical NaN; inf; -0 sums to +0 (the fold starts from +0);
    # subnormals are IEEE on the CPU too (as on the GPU), not flushed.
    x = np.ones((6, 2 * C + 9), np.float32)
    x[0, 5] = np.uint32(0x7FC12345).view(np.float32)
    x[1, C + 3] = np.inf
    x[2, 7], x[2, C + 7] = np.inf, -np.inf
    x[3] = -0.0
    x[4] = np.float32(1e-40) * np.arange(x.shape[1], dtype=np.float32) % np.float32(3e-39)
    x[5, 2 * C :] = np.float32(-(2.0**-140))
    got = jaxdet.sum(jnp.asarray(x), 1)
    assert_bitwise(got, ref.canonical_sum(x, (1,), np.float32))
    bits = np.asarray(got).view(np.uint32)
    assert bits[0] == 0x7FC00000 and np.isinf(got[1]) and bits[2] == 0x7FC00000 and bits[3] == 0
    assert 0 < got[4] < np.float32(np.finfo(np.float32).tiny) * 1e6
    assert_bitwise(jaxdet.sum(jnp.asarray(x[3:4]).astype(BF16), 1), np.zeros(1, BF16))


def test_empty_and_size_one():
    assert_bitwise(jaxdet.sum(jnp.zeros((3, 0, 2)), 1), np.zeros((3, 2), np.float32))
    assert jaxdet.sum(jnp.zeros((0, 5), BF16), 1).shape == (0,)
    assert_bitwise(jaxdet.sum(jnp.zeros((0,), BF16)), np.zeros((), BF16))
    x = rand((4, 3), F32, seed=3)
    # No axes: nothing is added, x comes back (as jnp.sum(x, axis=()) does); a size-1 axis is one add to +0.
    assert_bitwise(jaxdet.sum(x, ()), x)
    assert_bitwise(jaxdet.sum(x[:, :1], 1), x[:, 0])
    assert_bitwise(jaxdet.sum(jnp.float32(2.5)), np.float32(2.5))


def test_keepdims_and_axis_spellings():
    x = rand((3, 4, 5), F32, seed=4)
    assert jaxdet.sum(x, (0, 2), keepdims=True).shape == (1, 4, 1)
    assert jaxdet.sum(x, keepdims=True).shape == (1, 1, 1)
    assert_bitwise(jaxdet.sum(x, [2, 0]), jaxdet.sum(x, (0, 2)))
    assert_bitwise(jaxdet.sum(x, -1), jaxdet.sum(x, 2))
    assert_bitwise(jaxdet.sum(x, np.int64(1)), jaxdet.sum(x, 1))
    assert_bitwise(jaxdet.sum(x), jaxdet.sum(x, (0, 1, 2)))
    assert_bitwise(jaxdet.sum(np.asarray(x), 1), jaxdet.sum(x, 1))  # NumPy input


def test_reduce_sum_has_reduce_sum_p_semantics():
    # The entry point of jaxdet.invariant: axes a tuple of non-negative ints (any order), the axes
    # removed, the result in out_dtype.
    x = rand((3, 9000, 4), BF16, seed=5)
    assert_bitwise(reduce_sum(x, (2, 0), F32), jaxdet.sum(x, (0, 2), dtype=F32))
    assert_bitwise(reduce_sum(x, (1,), BF16), jaxdet.sum(x, 1))
    assert_bitwise(reduce_sum(x, (), BF16), x)
    with pytest.raises(ValueError, match="non-negative"):
        reduce_sum(x, (-1,), BF16)
    with pytest.raises(ValueError, match="duplicate"):
        reduce_sum(x, (1, 1), BF16)
    with pytest.raises(TypeError, match="float32"):
        reduce_sum(x, (1,), jnp.float16)


# ---- the consequences -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,K", [(F32, 3 * C + 1), (BF16, C + 700)], ids=["f32", "bf16"])
def test_output_bits_do_not_depend_on_other_outputs_or_sizes(dtype, K):
    expect(contracts.check_independence(dtype, K=K))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_appended_zeros_change_no_bit(dtype):
    expect(contracts.check_zero_padding(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pieces_of_2j_chunks_combine_by_tree_sum(dtype):
    expect(contracts.check_pieces(dtype, chunks=(4, 5, 8)))


@pytest.mark.parametrize(
    "dtype,tokens",
    [(F32, (1, 300, C, 3 * C + 5, 5 * C + 17)), (BF16, (8193, 5 * C + 17)), (jnp.float16, (8193, 4 * C))],
    ids=DTYPE_IDS,
)
def test_equals_matmul_weight_grad_on_the_cpu(dtype, tokens):
    expect(contracts.check_matmul_weight_grad(dtype, tokens=tokens))


# ---- transformations --------------------------------------------------------------------------------


def test_eager_jit_and_run_to_run():
    x = rand((33, 2 * C + 5), BF16, seed=6)
    assert_bitwise(jax.jit(lambda x: jaxdet.sum(x, 1))(x), jaxdet.sum(x, 1))
    assert_bitwise(jax.jit(lambda x: jaxdet.sum(x, 0, dtype=F32))(x), jaxdet.sum(x, 0, dtype=F32))
    expect(contracts.check_run_to_run(BF16, shape=(16, 2 * C + 5)))


def test_vmap_equals_loop():
    x = rand((4, 6, 3 * C + 11), F32, seed=7)
    moved = jnp.moveaxis(x, 0, 2)
    for axis, in_axes in ((0, 0), (-1, 2), ((0, 1), 0)):
        loop = jnp.stack([jaxdet.sum(x[i], axis) for i in range(4)])
        xin = x if in_axes == 0 else moved
        assert_bitwise(jax.vmap(lambda v: jaxdet.sum(v, axis), in_axes=in_axes)(xin), loop, f"axis {axis}")
    nested = jax.vmap(jax.vmap(lambda v: jaxdet.sum(v)))(x[:, :, :100])
    assert_bitwise(nested, jaxdet.sum(x[:, :, :100], 2))
    # The primitive's own batching rule (vmap of the custom_vjp's forward under grad).
    per_example = jax.vmap(jax.grad(lambda v: jnp.sum(jnp.sin(jaxdet.sum(v * v, 1)))))(x[:, :, :50])
    for i in range(4):
        assert_bitwise(per_example[i], jax.grad(lambda v: jnp.sum(jnp.sin(jaxdet.sum(v * v, 1))))(x[i, :, :50]))


def test_grad_is_the_broadcast_and_second_order_is_canonical():
    x = rand((3, 2 * C + 1, 4), BF16, seed=8)
    c = rand((3, 4), F32, seed=9)
    dx = jax.grad(lambda x: jnp.vdot(jaxdet.sum(x, 1, dtype=F32), c))(x)
    assert dx.dtype == BF16
    assert_bitwise(dx, jnp.broadcast_to(c.astype(BF16)[:, None, :], x.shape))
    # The cotangent of that broadcast is the canonical sum again (a second derivative).
    y = rand(x.shape, F32, seed=10)

    def first(c):
        return jnp.vdot(jax.grad(lambda x: jnp.vdot(jaxdet.sum(x, 1), c))(x.astype(F32)), y)

    assert_bitwise(jax.grad(first)(c), jaxdet.sum(y, 1))
    # The sum's gradient through a full reduction, against jnp.
    x32 = rand((5, 7), F32, seed=11)
    np.testing.assert_allclose(
        jax.grad(lambda x: jaxdet.sum(jnp.sin(x)))(x32), jax.grad(lambda x: jnp.sum(jnp.sin(x)))(x32), rtol=1e-6
    )


def test_under_remat_and_scan():
    x = rand((8, 3000), F32, seed=12)
    f = lambda x: jnp.sum(jnp.sin(jaxdet.sum(jnp.tanh(x), 1)))
    assert_bitwise(jax.grad(jax.checkpoint(f))(x), jax.grad(f)(x))

    def body(carry, xi):
        s = jaxdet.sum(xi, 1)
        return carry + jaxdet.sum(s), s

    total, rows = jax.lax.scan(body, jnp.float32(0), x.reshape(4, 2, 3000))
    assert_bitwise(rows.reshape(8), jaxdet.sum(x, 1))
    grads = jax.grad(lambda x: jax.lax.scan(body, jnp.float32(0), x)[0])(x.reshape(4, 2, 3000))
    assert_bitwise(grads, jnp.ones((4, 2, 3000), F32))


def test_forward_mode_of_sum_is_the_sum_of_the_tangent():
    # jaxdet.sum is linear: its tangent is the canonical sum of the tangent (bitwise).
    x, t = rand((4, 8), F32, seed=13), rand((4, 8), F32, seed=14)
    assert_bitwise(jax.jvp(lambda x: jaxdet.sum(x, 1), (x,), (t,))[1], jaxdet.sum(t, 1))
    with pytest.raises(TypeError, match=r"jaxdet\.bias_add supports reverse-mode"):
        jax.jvp(lambda x: jaxdet.bias_add(x, x[0]), (x,), (x,))


# ---- bias_add ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_bias_add_and_its_gradient(dtype):
    # Tokens over three leading dims, 2 chunks and a bit: db is the canonical sum over the tokens
    # (row-major), rounded once to b's dtype; dx is the cotangent itself.
    x = rand((2, 3, C // 3 + 11, 24), dtype, seed=14)
    b = rand((24,), dtype, seed=15)
    g = rand(x.shape, dtype, seed=16)
    y, vjp = jax.vjp(jaxdet.bias_add, x, b)
    assert_bitwise(y, x + b)
    dx, db = vjp(g)
    assert_bitwise(dx, g)
    assert db.dtype == dtype
    assert_bitwise(db, ref.canonical_sum(np.asarray(g).reshape(-1, 24), (0,), dtype))
    assert_bitwise(jax.jit(vjp)(g)[1], db)
    # A rank-1 x: one token.
    _, vjp1 = jax.vjp(jaxdet.bias_add, x[0, 0, 0], b)
    assert_bitwise(vjp1(g[0, 0, 0])[1], jaxdet.sum(g[0, 0, 0][None], 0))


def test_bias_add_bad_inputs():
    x = jnp.ones((4, 8), F32)
    with pytest.raises(TypeError, match="same dtype"):
        jaxdet.bias_add(x, jnp.ones((8,), BF16))
    with pytest.raises(ValueError, match=r"b must have shape \(8,\)"):
        jaxdet.bias_add(x, jnp.ones((4, 8), F32))
    with pytest.raises(ValueError, match="at least one dimension"):
        jaxdet.bias_add(jnp.float32(1), jnp.ones((), F32))
    with pytest.raises(TypeError, match="jnp.sum"):
        jaxdet.bias_add(x.astype(jnp.int32), jnp.ones((8,), jnp.int32))
    with pytest.raises(TypeError, match="must be a JAX or NumPy array"):
        jaxdet.bias_add([[1.0]], jnp.ones((1,)))


# ---- bad input ---------------------------------------------------------------------------------------


def test_bad_inputs_raise_clear_errors():
    x = jnp.ones((4, 8), F32)
    with pytest.raises(TypeError, match=r"int32; integer and bool sums are exact.*use jnp\.sum"):
        jaxdet.sum(x.astype(jnp.int32))
    with pytest.raises(TypeError, match=r"bool.*jnp\.sum"):
        jaxdet.sum(x > 0)
    with pytest.raises(TypeError, match="float32, bfloat16 or float16, got float64"):
        jaxdet.sum(np.ones((3,), np.float64))
    with pytest.raises(TypeError, match="must be a JAX or NumPy array"):
        jaxdet.sum([1.0, 2.0])
    with pytest.raises(ValueError, match="out of range"):
        jaxdet.sum(x, 2)
    with pytest.raises(ValueError, match="duplicate"):
        jaxdet.sum(x, (1, -1))
    with pytest.raises(TypeError, match="axis must be None, an int or a tuple of ints"):
        jaxdet.sum(x, 1.0)
    with pytest.raises(TypeError, match="dtype must be None, the input dtype"):
        jaxdet.sum(x, dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="dtype must be None, the input dtype"):
        jaxdet.sum(x.astype(BF16), dtype=jnp.float16)


# ---- many devices (8 simulated CPU devices) -------------------------------------------------------


@many_devices
def test_shard_map_local_and_split_reductions():
    m = mesh()
    x = rand((8, C + 5, 6), F32, seed=20)
    # A kept axis sharded: each device sums its own outputs, the unsharded bits, varying like x.
    seen = {}

    def local(x):
        out = jaxdet.sum(x, 1)
        seen["vma"] = jax.typeof(out).mat.varying
        return out

    out = jax.jit(jax.shard_map(local, mesh=m, in_specs=P("data"), out_specs=P("data")))(x)
    assert_bitwise(out, jaxdet.sum(x, 1))
    assert seen["vma"] == frozenset({"data"})
    # The reduced axis sharded, every device holding 2^j whole chunks: the devices' float32 sums
    # combined by tree_psum give the single-device bits for every device count.
    xs = rand((8 * C, 5), BF16, seed=21)
    whole = jaxdet.sum(xs, 0, dtype=F32)
    for d in (1, 2, 4, 8):
        f = jax.shard_map(
            lambda v: parallel.tree_psum(jaxdet.sum(v, 0, dtype=F32), "data"),
            mesh=mesh(d),
            in_specs=P("data"),
            out_specs=P(),
        )
        assert_bitwise(jax.jit(f)(xs), whole, f"{d} devices")
    # jax.grad inside shard_map: the cotangent is the broadcast, varying like x.
    g = jax.jit(
        jax.shard_map(
            jax.grad(lambda x: jnp.sum(jnp.sin(jaxdet.sum(x, 1)))), mesh=m, in_specs=P("data"), out_specs=P("data")
        )
    )(x)
    assert_bitwise(g, jax.grad(lambda x: jnp.sum(jnp.sin(jaxdet.sum(x, 1))))(x))


@many_devices
@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_sharded_jit(shardy):
    m2 = mesh(names=("x", "y"), shape=(2, 4))
    x = rand((8, 2 * C, 16), BF16, seed=22)
    with partitioner(shardy):
        # Kept axes split: per device, no collective, the output sharded like them.
        for spec, axis, out_spec in ((P("x", None, "y"), 1, P("x", "y")), (P(("x", "y")), (1, 2), P(("x", "y")))):
            xs = put(x, m2, spec)
            out = jax.jit(lambda v: jaxdet.sum(v, axis))(xs)
            assert_bitwise(out, jaxdet.sum(x, axis), f"{spec} axis {axis}")
            assert out.sharding.spec == out_spec, (spec, out.sharding.spec)
            assert collectives(lambda v: jaxdet.sum(v, axis), xs) == {}, spec
        # The reduced axis split: 8 * C tokens over 2, 4, 8 devices hold 4, 2, 1 whole chunks each:
        # reduced per device, the float32 partials meet by the canonical tree (data movement only).
        t = rand((8 * C, 12), F32, seed=23)
        whole = jaxdet.sum(t, 0)
        for d in (2, 4, 8) if shardy else (8,):
            ts = put(t, mesh(d), P("data"))
            assert_bitwise(jax.jit(lambda v: jaxdet.sum(v, 0))(ts), whole, f"tokens on {d} devices")
            found = collectives(lambda v: jaxdet.sum(v, 0), ts)
            assert found.get("all-to-all") and not set(found) & set(NO_SUM), found
        # Not whole chunks per device (6 chunks on 4 devices; 8 * C + 8 tokens on 8): all-gathered.
        for tokens, d in ((6 * C, 4), (8 * C + 8, 8)):
            u = rand((tokens, 3), F32, seed=24)
            us = put(u, mesh(d), P("data"))
            assert_bitwise(jax.jit(lambda v: jaxdet.sum(v, 0))(us), jaxdet.sum(u, 0), f"{tokens} on {d}")
            assert not set(collectives(lambda v: jaxdet.sum(v, 0), us)) & set(NO_SUM)
        # Two reduced axes, the leading one split; a full reduction to a scalar.
        xs = put(x, m2, P("x"))
        assert_bitwise(jax.jit(lambda v: jaxdet.sum(v, (0, 1)))(xs), jaxdet.sum(x, (0, 1)))
        assert_bitwise(jax.jit(lambda v: jaxdet.sum(v))(xs), jaxdet.sum(x))


@many_devices
@pytest.mark.parametrize("dtype,counts", [(F32, (1, 8)), (BF16, (1, 2, 4, 8))], ids=["f32", "bf16"])
def test_bias_add_gradient_is_device_count_invariant(dtype, counts):
    # Every device holds 2^j whole chunks of tokens (8 chunks: 1 per device at D = 8): plain
    # jax.grad inside shard_map (b replicated, x sharded) and sharded jit give one device's bits.
    x = rand((8, C, 16), dtype, seed=25)
    b = rand((16,), dtype, seed=26)
    loss = lambda b, x: jnp.sum(jnp.sin(jaxdet.bias_add(x, b).astype(F32)))
    grads = jax.grad(loss, argnums=(0, 1))
    reference = jax.jit(grads)(b, x)
    for d in counts:
        m = mesh(d)
        f = jax.shard_map(grads, mesh=m, in_specs=(P(), P("data")), out_specs=(P(), P("data")))
        db, dx = jax.jit(f)(b, x)
        assert_bitwise(db, reference[0], f"shard_map db, {d} devices")
        assert_bitwise(dx, reference[1], f"shard_map dx, {d} devices")
        bd, xd = put(b, m, P()), put(x, m, P("data"))
        db, dx = jax.jit(grads)(bd, xd)
        assert_bitwise(db, reference[0], f"sharded jit db, {d} devices")
        assert_bitwise(dx, reference[1], f"sharded jit dx, {d} devices")
        if d > 1:
            for fn, args in ((f, (b, x)), (grads, (bd, xd))):
                found = collectives(fn, *args)
                assert not set(found) & set(NO_SUM), found


# ---- GPU (pytest -m gpu): CPU == GPU bitwise --------------------------------------------------------

GPU_CASES = contracts.DEVICE_CASES + (
    ((8192, 2048), 0),  # the big cases: [T, d] -> [d] and -> [T], the vocabulary row
    ((8192, 2048), 1),
    ((8, 128256), 1),
    ((4096, 34), 0),  # B * 2 bytes not a multiple of 16: 4-byte pieces (bfloat16/float16)
    ((33, 1030), 1),  # K * 2 bytes likewise
    ((2, 100, 7), 1),  # a small B > 1
    ((1, 5 * C + 17), None),  # one output, many chunks
)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_equals_cpu_bitwise(dtype, on_gpu):
    expect(contracts.check_cpu_equals_device(dtype, cases=GPU_CASES))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gpu_matches_the_rule_and_its_consequences(dtype, on_gpu):
    expect(contracts.check_reference(dtype, cases=CASES))
    expect(contracts.check_independence(dtype, K=3 * C + 1))
    expect(contracts.check_zero_padding(dtype))
    expect(contracts.check_pieces(dtype))
    expect(contracts.check_run_to_run(dtype, shape=(4096, 3 * C + 5)))


@pytest.mark.gpu
def test_gpu_bias_add_gradient_equals_cpu(on_gpu, cpu):
    x, b = rand((4, 3 * C + 7, 96), BF16, seed=27), rand((96,), BF16, seed=28)
    grads = jax.jit(jax.grad(lambda b, x: jnp.sum(jnp.sin(jaxdet.bias_add(x, b).astype(F32))), argnums=(0, 1)))
    on_dev = grads(b, x)
    on_cpu = grads(*jax.device_put((b, x), cpu))
    for a, e in zip(on_dev, on_cpu):
        assert_bitwise(a, e)
