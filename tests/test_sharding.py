"""jaxdet on many devices: every contract of docs/sharding.md, on 8 simulated CPU devices.

XLA's CPU device count is fixed when the backend starts, so when this process has fewer than 8
devices the file runs itself once in a child pytest with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and each test here reports its outcome there.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from multidevice import COLLECTIVES, IN_CHILD, NDEV, collectives, mesh, on_devices, partitioner, put, rand  # noqa: E402, F401

import jaxdet
from jaxdet import parallel
from jaxdet import random as jr

# ---- shard_map (check_vma=True): types, gradients, transformations. ----


@on_devices
def test_outputs_vary_like_their_inputs_under_shard_map():
    m = mesh()
    a, b = rand((64, 96), seed=1), rand((96, 16), seed=2)
    key = jr.key(3)
    seen = {}

    def record(a, b, key):
        index = lax.axis_index("data")
        out = {
            "matmul": jaxdet.matmul(a, b),
            "matmul_weight_grad": jaxdet.matmul_weight_grad(a, a),
            "dropout": jaxdet.dropout(a, key, 0.5),
            "dropout_traced_offset": jaxdet.dropout(b, key, 0.5, offset=index * b.size),
            "fold_in": jr.fold_in(key, 1),
            "fold_in_index": jr.fold_in(key, index),
            "split": jr.split(key, 3),
            "philox": jr.philox4x32_10(jnp.zeros((4, 4), jnp.uint32), key),
            "vmap_matmul": jax.vmap(jaxdet.matmul, in_axes=(0, None))(a.reshape(2, -1, 96), b),
        }
        seen.update({k: jax.typeof(v).mat.varying for k, v in out.items()})
        return a

    jax.shard_map(record, mesh=m, in_specs=(P("data"), P(), P()), out_specs=P("data"))(a, b, key)
    data = frozenset({"data"})
    assert seen == {
        "matmul": data,
        "matmul_weight_grad": data,
        "dropout": data,
        "dropout_traced_offset": data,
        "fold_in": frozenset(),
        "fold_in_index": data,
        "split": frozenset(),
        "philox": frozenset(),
        "vmap_matmul": data,
    }
    # A varying result cannot be returned as replicated (it used to return one shard's rows).
    with pytest.raises(ValueError, match="out_specs"):
        jax.shard_map(jaxdet.matmul, mesh=m, in_specs=(P("data"), P()), out_specs=P())(a, b)
    out = jax.shard_map(jaxdet.matmul, mesh=m, in_specs=(P("data"), P()), out_specs=P("data"))(a, b)
    assert_bitwise(out, jaxdet.matmul(a, b))


def _mlp_loss(params, x, key, first):
    """A data-parallel loss over this device's examples x[b, s, d], whose first global example is
    `first`: the dropout offset is the global position of this device's activations."""
    w1, w2 = params
    h = jaxdet.matmul(x, w1)
    h = jaxdet.dropout(h, key, 0.2, offset=first * h[0].size)
    y = jaxdet.matmul(h, w2)  # only jaxdet ops and a sum of squares: no XLA fusion choice moves bits
    return jnp.sum(y * y)


@on_devices
@pytest.mark.parametrize("variant", ["plain", "jit", "remat", "scan", "vmap"])
def test_shard_map_data_parallel_gradients(variant):
    # The weights are invariant over 'data' and the examples vary: jax.grad inside shard_map gives
    # invariant weight gradients (the canonical tree over the devices' float32 partials, never a
    # psum) and the per-example activations' gradients of the unsharded call.
    m = mesh()
    x = rand((16, 12, 24), seed=4)
    params = (rand((24, 32), seed=5) / 5, rand((32, 24), seed=6) / 5)
    key = jr.key(7)
    per = 16 // NDEV

    def local_loss(params, x, first):
        if variant == "scan":  # one example at a time, each with its own global offset

            def body(total, xi_i):
                xi, i = xi_i
                return total + _mlp_loss(params, xi[None], key, first + i), None

            total = jnp.float32(0)
            if isinstance(first, jax.core.Tracer):  # inside shard_map the carry varies, as the loss does
                total = lax.pcast(total, "data", to="varying")
            return lax.scan(body, total, (x, jnp.arange(per)))[0]
        if variant == "vmap":  # per-example losses, each example's offset its global index
            losses = jax.vmap(lambda xi, i: _mlp_loss(params, xi[None], key, first + i))(x, jnp.arange(per))
            return jnp.sum(losses)
        loss = jax.checkpoint(_mlp_loss) if variant == "remat" else _mlp_loss
        return loss(params, x, key, first)

    grad = jax.grad(lambda p, x: local_loss(p, x, lax.axis_index("data") * per), argnums=(0, 1))
    if variant == "jit":
        grad = jax.jit(grad)
    (dw1, dw2), dx = jax.shard_map(grad, mesh=m, in_specs=((P(), P()), P("data")), out_specs=((P(), P()), P("data")))(
        params, x
    )
    # dX is row-local: bitwise the device's own gradient; dW: the devices' local gradients
    # combined by the canonical tree (float32).
    local = [jax.grad(local_loss, argnums=(0, 1))(params, x[d * per : (d + 1) * per], d * per) for d in range(NDEV)]
    assert_bitwise(dx, jnp.concatenate([g[1] for g in local]), "dx")
    expected = parallel.tree_sum([g[0] for g in local])
    if variant in ("scan", "vmap"):
        # The weights meet varying activations once per step (per example), so every step's
        # weight gradient is reduced across devices there; the steps' (2) reduced gradients are
        # then summed (by the scan's accumulation, by vmap's sum over the unbatched weights).
        def step(d, i):
            return jax.grad(_mlp_loss)(params, x[d * per + i][None], key, d * per + i)

        expected = jax.tree.map(
            lambda a, b: a + b, *[parallel.tree_sum([step(d, i) for d in range(NDEV)]) for i in range(per)]
        )
    assert_bitwise(dw1, expected[0], "dw1")
    assert_bitwise(dw2, expected[1], "dw2")
    if variant == "plain":  # and dX is the unsharded call's, row for row
        assert_bitwise(dx, jax.grad(lambda x: _mlp_loss(params, x, key, 0))(x), "dx unsharded")


@on_devices
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_weight_gradient_is_device_count_invariant(dtype):
    # docs/sharding.md alignment: every device holds WGRAD_CHUNK_TOKENS * 2^j tokens. Then plain
    # jax.grad inside shard_map, and jit with batch-sharded inputs, give the bits of one device.
    c = jaxdet.WGRAD_CHUNK_TOKENS
    x = rand((8, c, 16), dtype, seed=8)  # 8 chunks: 1 per device at D = 8
    w = rand((16, 24), dtype, seed=9)
    loss = lambda w, x: jnp.sum(jnp.sin(jaxdet.matmul(x, w).astype(jnp.float32)))
    reference = jax.jit(jax.grad(loss))(w, x)
    for d in (1, 2, 4, 8):
        m = mesh(d)
        in_shard_map = jax.jit(jax.shard_map(jax.grad(loss), mesh=m, in_specs=(P(), P("data")), out_specs=P()))
        assert_bitwise(in_shard_map(w, x), reference, f"shard_map, {d} devices")
        sharded = jax.jit(jax.grad(loss))
        wd, xd = put(w, m, P()), put(x, m, P("data"))
        assert_bitwise(sharded(wd, xd), reference, f"sharded jit, {d} devices")
        if d > 1:
            # The devices' partials meet by data movement only (all_to_all + all_gather), no psum.
            found = collectives(jax.grad(loss), wd, xd)
            assert "all-reduce" not in found and "reduce-scatter" not in found, found
        # matmul_weight_grad per device + tree_psum: the same bits (the micro-batch contract).
        dc = jnp.cos(jaxdet.matmul(x, w).astype(jnp.float32)).astype(dtype)
        per_device = jax.jit(
            jax.shard_map(
                lambda x, dc: parallel.tree_psum(jaxdet.matmul_weight_grad(x, dc), "data"),
                mesh=m,
                in_specs=(P("data"), P("data")),
                out_specs=P(),
            )
        )
        assert_bitwise(per_device(x, dc).astype(dtype), reference, f"matmul_weight_grad, {d} devices")


@on_devices
def test_weight_gradient_sharded_jit_any_device_count():
    # The padded canonical tree lines up with any device count: 6 chunks over 3 or 6 devices give
    # one device's bits in sharded jit. (Inside shard_map, tree_psum needs a power of two.)
    c = jaxdet.WGRAD_CHUNK_TOKENS
    x, w = rand((6 * c, 16), seed=33), rand((16, 8), seed=34)
    loss = lambda w, x: jnp.sum(jnp.sin(jaxdet.matmul(x, w)))
    reference = jax.jit(jax.grad(loss))(w, x)
    for d in (3, 6):
        m = mesh(d)
        assert_bitwise(jax.jit(jax.grad(loss))(put(w, m, P()), put(x, m, P("data"))), reference, f"{d} devices")
    with pytest.raises(ValueError, match="power of two"):
        jax.shard_map(jax.grad(loss), mesh=mesh(6), in_specs=(P(), P("data")), out_specs=P())(w, x)


@on_devices
def test_shard_map_dropout_offset_idiom_and_invariant_inputs():
    m = mesh()
    x = rand((16, 40), jnp.bfloat16, seed=10)
    key = jr.key(11)
    # Idiom: a leading-dim shard passes its global start as the offset.
    f = lambda x: jaxdet.dropout(x, key, 0.3, offset=lax.axis_index("data") * x.size)
    out = jax.shard_map(f, mesh=m, in_specs=P("data"), out_specs=P("data"))(x)
    assert_bitwise(out, jaxdet.dropout(x, key, 0.3))
    g = jax.shard_map(
        jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32) ** 2)), mesh=m, in_specs=P("data"), out_specs=P("data")
    )(x)
    assert_bitwise(g, jax.grad(lambda x: jnp.sum(jaxdet.dropout(x, key, 0.3).astype(jnp.float32) ** 2))(x))
    # An x invariant over the axis that its key varies over: its cotangent is the canonical tree
    # over the devices' masked cotangents (float32, cast once), typed invariant.
    y = rand((6, 10), jnp.bfloat16, seed=12)

    def per_device(y):
        k = jr.fold_in(key, lax.axis_index("data"))
        return jax.grad(lambda y: jnp.sum(jaxdet.dropout(y, k, 0.5).astype(jnp.float32) ** 2))(y)

    def on_one_device(y, d):
        return jax.grad(lambda y: jnp.sum(jaxdet.dropout(y, jr.fold_in(key, d), 0.5).astype(jnp.float32) ** 2))(y)

    dy = jax.shard_map(per_device, mesh=m, in_specs=P(), out_specs=P())(y)
    parts = [on_one_device(y, d) for d in range(NDEV)]
    assert_bitwise(dy, parallel.tree_sum([p.astype(jnp.float32) for p in parts]).astype(jnp.bfloat16))


@on_devices
def test_second_derivatives_inside_shard_map():
    # A gradient penalty differentiates the backward, its canonical tree included.
    m = mesh()
    x, w = rand((16, 24), seed=29), rand((24, 8), seed=30)

    def penalty(w, x):
        gx = jax.grad(lambda x: jnp.sum(jnp.sin(jaxdet.matmul(x, w))))(x)
        return jnp.sum(gx * gx)

    g = jax.shard_map(jax.grad(penalty), mesh=m, in_specs=(P(), P("data")), out_specs=P())(w, x)
    ref = jax.grad(penalty)(w, x)
    assert jax.typeof(g).shape == w.shape
    assert float(jnp.linalg.norm(g - ref) / jnp.linalg.norm(ref)) < 1e-5


@on_devices
def test_partly_manual_shard_map():
    # Manual over 'data' only, 'model' left to the partitioner: the bits of the fully manual map.
    m = mesh(names=("data", "model"), shape=(2, 4))
    x, w = rand((16, 24), seed=31), rand((24, 8), seed=32)

    def loss(w, x):
        return jnp.sum(jaxdet.dropout(jaxdet.matmul(x, w), jr.key(0), 0.5) ** 2)

    partly = jax.jit(
        jax.shard_map(jax.grad(loss), mesh=m, in_specs=(P(), P("data")), out_specs=P(), axis_names={"data"})
    )
    fully = jax.shard_map(jax.grad(loss), mesh=mesh(2), in_specs=(P(), P("data")), out_specs=P())
    assert_bitwise(partly(put(w, m, P(None, "model")), x), fully(w, x))


# ---- Sharded jit: partitioning rules (custom_partitioning; Shardy and GSPMD). ----


@on_devices
@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_matmul_sharded_jit_runs_per_shard(shardy):
    m = mesh(names=("x", "y"), shape=(2, 4))
    a, b = rand((16, 8, 96), seed=13), rand((96, 40), seed=14)
    bb = rand((16, 96, 40), seed=15)
    cases = [
        (a, b, P("x"), P(), P("x")),  # data parallel: a's batch, b replicated
        (a, b, P(("x", "y")), P(), P(("x", "y"))),  # over both mesh axes
        (a, b, P(None, "y"), P(), P(None, "y")),  # rows of a
        (a, b, P(), P(None, "y"), P(None, None, "y")),  # tensor parallel: b's columns
        (a, b, P("x"), P(None, "y"), P("x", None, "y")),  # both
        (a, bb, P("x"), P("x"), P("x")),  # batched b, split with a's batch
    ]
    with partitioner(shardy):
        for x, w, sx, sw, s_out in cases:
            xs, ws = put(x, m, sx), put(w, m, sw)
            out = jax.jit(jaxdet.matmul)(xs, ws)
            assert_bitwise(out, jaxdet.matmul(x, w), f"{sx} @ {sw}")
            assert out.sharding.spec == s_out, (sx, sw, out.sharding.spec)
            assert collectives(jaxdet.matmul, xs, ws) == {}, (sx, sw)


@on_devices
def test_matmul_split_contraction_is_all_gathered_not_summed():
    # A sharded K would need a psum, whose order depends on the device count: jaxdet all-gathers
    # K instead, and the bits stay those of the unsharded call.
    m = mesh()
    a, b = rand((32, 64), seed=16), rand((64, 24), seed=17)
    xs, ws = put(a, m, P(None, "data")), put(b, m, P("data"))
    assert_bitwise(jax.jit(jaxdet.matmul)(xs, ws), jaxdet.matmul(a, b))
    found = collectives(jaxdet.matmul, xs, ws)
    assert found.get("all-gather") and "all-reduce" not in found and "reduce-scatter" not in found, found


@on_devices
@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_gemm_chunks_sharded_jit(shardy):
    # K beyond one chunk (the GEMM primitive with chunks of 64, docs/matmul.md): rows and the batch
    # split per device, a split K all-gathered: the bits of one device.
    from jaxdet._src.matmul.matmul import gemm_p

    def f(a, b):
        return gemm_p.bind(a, b, transpose_a=False, transpose_b=False, out_dtype=np.dtype(np.float32), chunk=64)

    m = mesh()
    a, b = rand((8, 16, 200), seed=40), rand((8, 200, 24), seed=41)
    ref = f(a, b)
    with partitioner(shardy):
        for sa, sb in ((P("data"), P("data")), (P(None, "data"), P()), (P(None, None, "data"), P(None, "data"))):
            assert_bitwise(jax.jit(f)(put(a, m, sa), put(b, m, sb)), ref, f"{sa} @ {sb}")


@on_devices
def test_gemm_chunks_in_shard_map_with_grad_scan_and_remat():
    # jaxdet.matmul with K and N beyond one chunk (GEMM_CHUNK, the public path) in a remat'ed
    # lax.scan body, differentiated inside jax.shard_map (default check_vma) with the rows split over
    # the devices: the forward contracts K, the second layer's dA contracts N, both by the chunk
    # rule; rows and their gradients keep the bits of one device.
    k = 2 * jaxdet.GEMM_CHUNK + 320
    x = rand((2 * NDEV, k), jnp.bfloat16, seed=50)
    w1 = rand((k, 32), jnp.bfloat16, seed=51) / 64
    w2 = rand((32, k), jnp.bfloat16, seed=52) / 8

    @jax.checkpoint
    def layer(h, _):
        return jnp.tanh(jaxdet.matmul(jaxdet.matmul(h, w1), w2)), None

    def rows_loss(x):
        h, _ = lax.scan(layer, x, None, length=2)
        return h, jnp.sum(h.astype(jnp.float32) ** 2, axis=1)

    def step(x):
        (h, per_row), vjp = jax.vjp(rows_loss, x)
        (dx,) = vjp((jnp.zeros_like(h), jnp.ones_like(per_row)))
        return h, dx

    ref_h, ref_dx = step(x)
    m = mesh()
    h, dx = jax.jit(jax.shard_map(step, mesh=m, in_specs=P("data"), out_specs=(P("data"), P("data"))))(x)
    assert_bitwise(h, ref_h, "outputs")
    assert_bitwise(dx, ref_dx, "dx")


@on_devices
def test_matmul_gradients_sharded_jit():
    m = mesh()
    x, w = rand((64, 96), seed=18), rand((96, 40), seed=19)
    loss = lambda w, x: jnp.sum(jaxdet.matmul(x, w) ** 2)
    grads = jax.grad(loss, argnums=(0, 1))
    reference = grads(w, x)
    # Batch-sharded activations: dA runs per shard. Here a device holds 8 tokens, not whole dB
    # chunks, so its chunk tree is not a subtree of the unsharded one: the tokens are all-gathered
    # for dB and the bits stay those of one device (an aligned split reduces per device: above).
    wd, xd = put(w, m, P()), put(x, m, P("data"))
    dw, dx = jax.jit(grads)(wd, xd)
    assert_bitwise(dw, reference[0], "dw")
    assert_bitwise(dx, reference[1], "dx")
    assert dx.sharding.spec == P("data")
    assert "all-reduce" not in collectives(grads, wd, xd)
    # Tensor parallel (w's columns split): dX contracts over the split columns, so they are
    # all-gathered (no psum); dW stays split.
    wd, xd = put(w, m, P(None, "data")), put(x, m, P())
    dw, dx = jax.jit(grads)(wd, xd)
    assert_bitwise(dw, reference[0], "dw")
    assert_bitwise(dx, reference[1], "dx")
    assert dw.sharding.spec == P(None, "data")
    assert "all-reduce" not in collectives(grads, wd, xd)


def _dropout_with(x, key, **kwargs):
    return jaxdet.dropout(x, key, 0.5, **kwargs)


@on_devices
@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_dropout_sharded_along_any_dimensions(shardy):
    # Each shard draws its part of the global mask: index = offset + sum_d (start_d + i_d) *
    # stride_d, no collective, the mask of the unsharded call bit for bit.
    m = mesh(names=("x", "y"), shape=(2, 4))
    x = rand((8, 12, 40), jnp.bfloat16, seed=20)
    key = jr.key(21)
    specs = [P("x"), P(None, "y"), P(None, None, ("x", "y")), P("y", "x"), P(None, "x", "y"), P(("y", "x"))]
    with partitioner(shardy):
        for spec in specs:
            xs = put(x, m, spec)
            for bdims in [(), (1,), (0, 2)]:
                for offset in (0, 2**33 + 3):
                    f = functools.partial(_dropout_with, offset=offset, broadcast_dims=bdims)
                    out = jax.jit(f)(xs, key)
                    assert_bitwise(out, f(x, key), f"{spec} broadcast_dims={bdims} offset={offset}")
                    assert out.sharding.spec == xs.sharding.spec
                    assert collectives(f, xs, key) == {}, (spec, bdims)
            # A traced offset and the backward (the same mask on the cotangent, per shard).
            f = lambda x, k, o: jaxdet.dropout(x, k, 0.5, offset=o)
            assert_bitwise(jax.jit(f)(xs, key, jnp.int32(77)), f(x, key, 77), f"{spec} traced offset")
            g = jax.grad(lambda x, k: jnp.sum(jaxdet.dropout(x, k, 0.5).astype(jnp.float32) ** 2))
            assert_bitwise(jax.jit(g)(xs, key), g(x, key), f"{spec} grad")
            assert collectives(g, xs, key) == {}


@on_devices
def test_vmapped_dropout_and_philox_sharded_jit():
    m = mesh(names=("x", "y"), shape=(2, 4))
    x = rand((8, 12, 40), jnp.float32, seed=22)
    keys = jr.split(jr.key(23), 8)
    f = jax.vmap(lambda xi, k: jaxdet.dropout(xi, k, 0.5))
    xs, ks = put(x, m, P("x", "y")), put(keys, m, P("x"))
    assert_bitwise(jax.jit(f)(xs, ks), f(x, keys))
    assert collectives(f, xs, ks) == {}
    counters = jnp.asarray(np.random.default_rng(24).integers(0, 2**32, (64, 4), dtype=np.uint32))
    cs = put(counters, m, P(("x", "y")))
    out = jax.jit(jr.philox4x32_10)(cs, jr.key(25))
    assert_bitwise(out, jr.philox4x32_10(counters, jr.key(25)))
    assert out.sharding.spec == P(("x", "y"))
    assert collectives(jr.philox4x32_10, cs, jr.key(25)) == {}


@on_devices
def test_explicit_sharding_types_follow_the_rules():
    # A mesh of AxisType.Explicit (jax.make_mesh's default): results are typed with the sharding
    # the partitioning rule produces, and nothing is gathered.
    m = jax.make_mesh((NDEV,), ("data",), axis_types=(AxisType.Explicit,))
    a, b = rand((64, 96), seed=26), rand((96, 40), seed=27)
    key = jr.key(28)
    with jax.set_mesh(m):
        xs, ws = put(a, m, P("data")), put(b, m, P())
        for f, args, expected in [
            (jaxdet.matmul, (xs, ws), jaxdet.matmul(a, b)),
            (lambda x, k: jaxdet.dropout(x, k, 0.5), (xs, key), jaxdet.dropout(a, key, 0.5)),
            (
                lambda x, k: jaxdet.dropout(x, k, 0.5, broadcast_dims=(1,)),
                (xs, key),
                jaxdet.dropout(a, key, 0.5, broadcast_dims=(1,)),
            ),
        ]:
            assert jax.typeof(jax.eval_shape(f, *args)).sharding.spec == P("data", None)
            assert_bitwise(jax.jit(f)(*args), expected)
            assert collectives(f, *args) == {}
        grads = jax.grad(lambda w, x: jnp.sum(jaxdet.matmul(x, w) ** 2), argnums=(0, 1))
        dw, dx = jax.jit(grads)(ws, xs)
        expected = grads(b, a)
        assert_bitwise(dw, expected[0], "dw")
        assert_bitwise(dx, expected[1], "dx")
        assert jax.typeof(dx).sharding.spec == P("data", None)
