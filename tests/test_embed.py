"""jaxdet.embed and jaxdet.segment_sum: each test proves one contract of docs/embed.md.
(Many devices: tests/test_embed_sharding.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise, bits
from jax.test_util import check_grads

import jaxdet
from jaxdet._src.embed import contracts, reference
from jaxdet._src.embed.contracts import rand, random_ids, table_grad

C = jaxdet.embed.CHUNK_TOKENS
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
IDS = ["f32", "bf16", "f16"]


@functools.partial(jax.jit, static_argnums=(2, 3))
def segsum(x, ids, v, preferred_element_type=None):
    return jaxdet.segment_sum(x, ids, v, preferred_element_type=preferred_element_type)


def left_fold(parts):
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


# ---- The rule. ----


def test_chunk_constant_is_dbs():
    assert jaxdet.embed.CHUNK_TOKENS == jaxdet.segment_sum.CHUNK_TOKENS == jaxdet.WGRAD_CHUNK_TOKENS == 8192


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_segment_sum_is_the_rule(dtype):
    # 1 token, a chunk and one token, 6 chunks; repeated ids, empty segments (V > the ids used), ids
    # out of range on both sides; the data scaled so that float32 sums round (and the tree differs
    # from the left fold).
    v = 11
    for tokens in (1, C + 1, 5 * C + 17):
        x = (rand((tokens, 4), jnp.float32, seed=tokens) * 1000).astype(dtype)
        ids = random_ids((tokens,), v, seed=tokens + 1, low=-2, high=v - 2)  # segments 9, 10 empty
        want = reference.segment_sum(np.asarray(x), np.asarray(ids), v)
        assert_bitwise(segsum(x, ids, v), want, f"{tokens} tokens")
        want32 = reference.segment_sum(np.asarray(x), np.asarray(ids), v, out_dtype=np.float32)
        assert_bitwise(segsum(x, ids, v, jnp.float32), want32, f"{tokens} tokens, float32 result")
        assert not np.any(bits(want32[9:])), "empty segments are +0"
    # The last case (6 chunks) tells the canonical tree from the left fold of the chunk partials.
    parts = list(reference.chunk_partials(np.asarray(x), np.asarray(ids), v))
    assert len(parts) == 6
    assert_bitwise(reference.tree_sum(parts), want32, "reference tree")
    assert not np.array_equal(bits(left_fold(parts)), bits(want32)), "inputs that tell the tree from the left fold"


def test_the_reference_is_dbs_chunk_tree():
    # The reference's tree is jaxdet.parallel.tree_sum's (3 chunks: (p0 + p1) + p2; 5: ((p0+p1)+(p2+p3))+p4).
    parts = [np.float32(x) for x in np.random.default_rng(0).standard_normal(5) * 1e4]
    assert reference.tree_sum(parts) == ((parts[0] + parts[1]) + (parts[2] + parts[3])) + parts[4]
    assert reference.tree_sum(parts[:3]) == (parts[0] + parts[1]) + parts[2]
    assert bits(reference.tree_sum(parts)) == bits(jaxdet.parallel.tree_sum([jnp.float32(p) for p in parts]))


def test_every_segment_depends_on_its_own_tokens_only():
    # Not on V, on D (other columns: the CPU handler's 64-column tiles), on the other segments'
    # tokens or on how many segments there are (work items of 32 segments on the thread pool).
    tokens, d = 2 * C + 5, 130
    x = rand((tokens, d), jnp.bfloat16, seed=3)
    ids = random_ids((tokens,), 10, seed=4)
    base = segsum(x, ids, 10)
    assert_bitwise(base, reference.segment_sum(np.asarray(x), np.asarray(ids), 10))
    assert_bitwise(segsum(x, ids, 1000)[:10], base, "V = 1000")
    assert_bitwise(segsum(x[:, :3], ids, 10), base[:, :3], "D = 3")
    other = jnp.where((ids == 4)[:, None], rand((tokens, d), jnp.bfloat16, seed=5), x)
    changed = segsum(other, ids, 10)
    keep = np.arange(10) != 4
    assert_bitwise(changed[keep], base[keep], "other segments' values changed")
    # many segments (V in the thousands, tokens spread thin): the NumPy rule
    many = random_ids((tokens,), 3000, seed=6)
    assert_bitwise(segsum(x[:, :5], many, 3000), reference.segment_sum(np.asarray(x[:, :5]), np.asarray(many), 3000))


def test_leading_token_dims_fold_row_major():
    x = rand((2, 3, 1500, 6), jnp.float16, seed=7)
    ids = random_ids((2, 3, 1500), 9, seed=8)
    assert_bitwise(segsum(x, ids, 9), segsum(x.reshape(-1, 6), ids.reshape(-1), 9))
    # other integer dtypes of the ids: the same sums
    for dt in (jnp.int8, jnp.uint8, jnp.int16, jnp.uint32):
        assert_bitwise(segsum(x, ids.astype(dt), 9), segsum(x, ids, 9), jnp.dtype(dt).name)


def test_special_values_and_subnormals():
    # inf, -inf (NaN when they meet, stored as the canonical NaN), subnormals (IEEE, not flushed), -0.
    x = np.zeros((8, 3), np.float32)
    x[:, 0] = [np.inf, 1.0, -np.inf, 2.0, 1e-40, 1e-40, -0.0, -0.0]
    x[:, 1] = [np.nan, 1.0, 3e-39, -3e-39, 1e-45, 0.0, 5.0, -5.0]
    x[:, 2] = np.float32(3e38)
    ids = jnp.asarray([0, 0, 0, 1, 2, 2, 3, 3], jnp.int32)
    for dtype in DTYPES:
        xd = jnp.asarray(x).astype(dtype)
        want = reference.segment_sum(np.asarray(xd), np.asarray(ids), 5)
        assert_bitwise(segsum(xd, ids, 5), want, jnp.dtype(dtype).name)
    out = np.asarray(segsum(jnp.asarray(x), ids, 5))
    assert bits(out[0, 0]) == 0x7FC00000 and out[2, 0] == np.float32(1e-40) * 2 and bits(out[3, 0]) == 0


# ---- embed: the forward is jnp.take, the table's gradient is the rule. ----


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_embed_forward_is_jnp_take(dtype):
    table = rand((50, 24), dtype, seed=9)
    ids = jnp.asarray([[0, 49, -1, -50], [-51, 50, 7, 7]], jnp.int32)  # wrap, out of range: NaN rows
    out = jaxdet.embed(table, ids)
    assert_bitwise(out, jnp.take(table, ids, axis=0))
    assert np.isnan(np.asarray(out[1, :2], np.float32)).all()
    assert_bitwise(out[0, 2], table[49], "negative ids count from the end")
    for dt in (jnp.uint8, jnp.int16, jnp.uint32):
        assert_bitwise(
            jaxdet.embed(table, jnp.asarray([3, 49, 255], dt)), jnp.take(table, jnp.asarray([3, 49, 255], dt), axis=0)
        )
    assert jaxdet.embed(table, jnp.zeros((0, 3), jnp.int32)).shape == (0, 3, 24)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_embed_table_gradient_is_the_rule(dtype):
    ok, detail = contracts.check_reference(dtype, tokens=3 * C + 17, d=4, num_segments=37)
    assert ok, detail
    # negative ids are wrapped in the backward as in the forward; ids out of range contribute nothing
    table = rand((20, 8), dtype, seed=10)
    ids = random_ids((3, 700), 20, seed=11, low=-25, high=25)
    g = rand((3, 700, 8), dtype, seed=12)
    wrapped = np.where((np.asarray(ids) < 0) & (np.asarray(ids) >= -20), np.asarray(ids) + 20, np.asarray(ids))
    want = reference.segment_sum(np.asarray(g).reshape(-1, 8), wrapped.reshape(-1), 20)
    assert_bitwise(table_grad(table, ids, g), want)
    # close to XLA's scatter-add (the same sum in another order)
    _, vjp = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)
    np.testing.assert_allclose(np.asarray(want, np.float32), np.asarray(vjp(g)[0], np.float32), rtol=5e-2, atol=0.5)
    # the ids get the integer inputs' zero cotangent
    _, vjp = jax.vjp(jaxdet.embed, table, ids)
    assert vjp(g)[1].dtype == jax.dtypes.float0


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_table_gradient_equals_the_one_hot_matmuls_db_on_the_cpu(dtype):
    ok, detail = contracts.check_one_hot_matmul(
        dtype, tokens=5 * C + 17, d=16, num_segments=40, device=jax.devices("cpu")[0]
    )
    assert ok, detail


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=IDS[:2])
def test_padding_tokens_change_no_bit(dtype):
    ok, detail = contracts.check_padding(dtype)
    assert ok, detail


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=IDS[:2])
def test_microbatches_of_whole_chunks_reproduce_the_batch(dtype):
    ok, detail = contracts.check_microbatches(dtype)
    assert ok, detail


# ---- Transformations. ----


def test_jit_eager_and_run_to_run():
    x = rand((C + 77, 5), jnp.bfloat16, seed=13)
    ids = random_ids((C + 77,), 30, seed=14)
    eager = jaxdet.segment_sum(x, ids, 30)
    assert_bitwise(segsum(x, ids, 30), eager)
    assert_bitwise(segsum(x, ids, 30), eager)
    table = rand((30, 5), jnp.bfloat16, seed=15)
    assert_bitwise(jax.jit(jaxdet.embed)(table, ids), jaxdet.embed(table, ids))


def test_vmap_is_per_example():
    x = rand((3, 900, 7), jnp.bfloat16, seed=16)
    ids = random_ids((3, 900), 12, seed=17)
    out = jax.vmap(lambda x, i: jaxdet.segment_sum(x, i, 12))(x, ids)
    shared = jax.vmap(lambda x: jaxdet.segment_sum(x, ids[0], 12), in_axes=1, out_axes=1)(x.transpose(1, 0, 2))
    for k in range(3):
        assert_bitwise(out[k], segsum(x[k], ids[k], 12), f"example {k}")
        assert_bitwise(shared[:, k], segsum(x[k], ids[0], 12), f"shared ids, example {k}")
    # per-example table gradients, nested vmap
    table = rand((12, 7), jnp.bfloat16, seed=18)
    grads = jax.vmap(jax.vmap(table_grad, in_axes=(None, 0, 0)), in_axes=(None, 0, 0))(
        table, ids.reshape(3, 3, 300), x.reshape(3, 3, 300, 7)
    )
    assert_bitwise(grads[2, 1], table_grad(table, ids[2, 300:600], x[2, 300:600]))
    # per-example tables
    tables = rand((3, 12, 7), jnp.float32, seed=19)
    got = jax.vmap(jax.grad(lambda t, i: jnp.sum(jnp.sin(jaxdet.embed(t, i)))))(tables, ids)
    assert_bitwise(got[1], jax.grad(lambda t: jnp.sum(jnp.sin(jaxdet.embed(t, ids[1]))))(tables[1]))


def test_grad_remat_scan_and_second_order():
    table = rand((40, 6), jnp.float32, seed=20)
    ids = random_ids((3, C), 40, seed=21)  # 3 micro-batches of one chunk
    loss = lambda t, i: jnp.sum(jnp.sin(jaxdet.embed(t, i)))
    full = jax.jit(jax.grad(loss))(table, ids)
    assert_bitwise(jax.jit(jax.grad(jax.checkpoint(loss)))(table, ids), full, "remat")
    # lax.scan over micro-batches: float32 partials accumulated in order (up to 3 chunks the tree is
    # the left fold), and each step's gradient is the unscanned one's
    g = jnp.cos(jaxdet.embed(table, ids))

    def step(acc, xs):
        i, gi = xs
        return acc + jaxdet.segment_sum(gi, i, 40, preferred_element_type=jnp.float32), jax.grad(loss)(table, i)

    acc, per_step = jax.jit(lambda: jax.lax.scan(step, jnp.zeros((40, 6)), (ids, g)))()
    assert_bitwise(acc, full, "scanned micro-batches")
    assert_bitwise(per_step[1], jax.grad(loss)(table, ids[1]), "scan step")
    # reverse over reverse: the backward is the custom_vjp pair again (no scatter anywhere)
    small = ids[0, :64]
    check_grads(lambda t: jnp.sum(jaxdet.embed(t, small) ** 2), (table,), order=2, modes=["rev"], eps=1e-2)
    second = lambda t: jnp.sum(jax.grad(lambda u: jnp.sum(jaxdet.embed(u, small) ** 3))(t) ** 2)
    assert "scatter" not in str(jax.make_jaxpr(jax.grad(second))(table))
    x = rand((64, 6), jnp.float32, seed=22)
    check_grads(lambda x: jnp.sum(jaxdet.segment_sum(x, small, 40) ** 2), (x,), order=2, modes=["rev"], eps=1e-2)


def test_segment_sum_gradient_is_the_gather():
    x = rand((500, 4), jnp.bfloat16, seed=23)
    ids = random_ids((500,), 10, seed=24, low=-3, high=13)
    g = rand((10, 4), jnp.bfloat16, seed=25)
    _, vjp = jax.vjp(lambda x: jaxdet.segment_sum(x, ids, 10), x)
    valid = ((ids >= 0) & (ids < 10))[:, None]
    assert_bitwise(vjp(g)[0], jnp.where(valid, g[jnp.clip(ids, 0, 9)], 0).astype(jnp.bfloat16))


def test_forward_mode_names_the_public_function():
    table = jnp.ones((4, 3), jnp.float32)
    ids = jnp.asarray([0, 1], jnp.int32)
    with pytest.raises(TypeError, match=r"jaxdet\.embed supports reverse-mode differentiation to any order"):
        jax.jvp(lambda t: jaxdet.embed(t, ids), (table,), (table,))
    with pytest.raises(TypeError, match=r"jaxdet\.segment_sum supports reverse-mode"):
        jax.jvp(lambda t: jaxdet.segment_sum(t, ids, 3), (table[:2],), (table[:2],))


def test_bad_arguments_raise_before_any_kernel():
    x = jnp.ones((6, 3), jnp.float32)
    ids = jnp.zeros((6,), jnp.int32)
    for bad in (jnp.ones((6, 3), jnp.int32), np.ones((6, 3), np.float64)):
        with pytest.raises(TypeError, match="data must be float32, bfloat16 or float16"):
            jaxdet.segment_sum(bad, ids, 4)
    for bad in (jnp.zeros((6,), jnp.float32), jnp.zeros((6,), jnp.bool_), [0] * 6):
        with pytest.raises(TypeError, match="segment_ids must be an integer"):
            jaxdet.segment_sum(x, bad, 4)
    with pytest.raises(ValueError, match=r"data must be \[\*T, D\] for segment_ids \[\*T\]"):
        jaxdet.segment_sum(x, jnp.zeros((5,), jnp.int32), 4)
    with pytest.raises(ValueError, match=r"data must be \[\*T, D\]"):
        jaxdet.segment_sum(x[:, 0], ids, 4)
    for bad, err in ((0, ValueError), (-3, ValueError), (2**31, ValueError), (4.0, TypeError), (True, TypeError)):
        with pytest.raises(err, match="num_segments"):
            jaxdet.segment_sum(x, ids, bad)
    with pytest.raises(TypeError, match="num_segments must be a static"):
        jax.jit(lambda n: jaxdet.segment_sum(x, ids, n))(4)
    with pytest.raises(TypeError, match="preferred_element_type"):
        jaxdet.segment_sum(x.astype(jnp.bfloat16), ids, 4, preferred_element_type=jnp.float16)
    with pytest.raises(TypeError, match="table must be float32, bfloat16 or float16"):
        jaxdet.embed(jnp.ones((4, 3), jnp.int32), ids)
    with pytest.raises(ValueError, match=r"table must be \[V, D\]"):
        jaxdet.embed(jnp.ones((4,), jnp.float32), ids)
    with pytest.raises(TypeError, match="ids must be an integer"):
        jaxdet.embed(x, jnp.zeros((2,), jnp.float32))


def test_empty_inputs():
    assert_bitwise(
        jaxdet.segment_sum(jnp.ones((0, 3), jnp.bfloat16), jnp.zeros((0,), jnp.int32), 4),
        jnp.zeros((4, 3), jnp.bfloat16),
    )
    assert jaxdet.segment_sum(jnp.ones((5, 0)), jnp.zeros((5,), jnp.int32), 2).shape == (2, 0)
    table = rand((7, 3), jnp.float32, seed=26)
    assert_bitwise(table_grad(table, jnp.zeros((0,), jnp.int32), jnp.zeros((0, 3))), jnp.zeros((7, 3)))


# ---- GPU (run with `pytest -m gpu`). ----


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gpu_bits_equal_cpu_bits(dtype):
    ok, detail = contracts.check_cpu_vs_gpu(dtype)
    assert ok, detail


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gpu_is_the_rule(gpu, dtype):
    # many chunks, a wide and a ragged D (16-byte rows and the scalar path), V in the thousands, a
    # heavy segment, vmap (L > 1), a float32 result of half data
    for tokens, d, v in ((9 * C + 3, 8, 5), (3000, 1031, 2000), (2 * C, 256, 3)):
        x = jax.device_put(rand((tokens, d), dtype, seed=d), gpu)
        ids = jax.device_put(random_ids((tokens,), v, seed=v, low=-1, high=v + 1), gpu)
        want = reference.segment_sum(np.asarray(x), np.asarray(ids), v)
        assert_bitwise(segsum(x, ids, v), want, f"{[tokens, d, v]}")
        want32 = reference.segment_sum(np.asarray(x), np.asarray(ids), v, out_dtype=np.float32)
        assert_bitwise(segsum(x, ids, v, jnp.float32), want32, f"{[tokens, d, v]} float32")
    x = jax.device_put(rand((4, 1000, 24), dtype, seed=1), gpu)
    ids = jax.device_put(random_ids((4, 1000), 50, seed=2), gpu)
    out = jax.jit(jax.vmap(lambda x, i: jaxdet.segment_sum(x, i, 50)))(x, ids)
    for k in range(4):
        assert_bitwise(out[k], reference.segment_sum(np.asarray(x[k]), np.asarray(ids[k]), 50), f"vmap {k}")


@pytest.mark.gpu
def test_gpu_table_gradient_equals_the_one_hot_matmuls_db_float32(gpu):
    ok, detail = contracts.check_one_hot_matmul(jnp.float32, tokens=5 * C + 17, d=40, num_segments=64, device=gpu)
    assert ok, detail
