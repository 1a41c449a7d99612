"""Norms, softmax, cross-entropy and attention on many devices (the "Many devices" sections of
docs/norm.md, docs/softmax.md and docs/attention.md), on 8 simulated CPU devices.

XLA's CPU device count is fixed when the backend starts, so when this process has fewer than 8
devices the file runs itself once in a child pytest with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and each test reports its outcome there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bitwise import assert_bitwise
from jax.sharding import PartitionSpec as P
from multidevice import IN_CHILD, NDEV, collectives, mesh, on_devices, put, rand  # noqa: F401

import jaxdet

NO_SUM = ("all-reduce", "reduce-scatter")


NORMS = {
    "rms": lambda x, w, b: jaxdet.rms_norm(x, w),
    "layer": lambda x, w, b: jaxdet.layer_norm(x, w, b),
}


def _norm_loss(kind):
    # A fixed cotangent per token (cos of a token-local value), summed: the gradient's token terms
    # do not depend on how the batch is split.
    return lambda w, b, x: jnp.sum(jnp.sin(NORMS[kind](x, w, b).astype(jnp.float32)))


# ---- shard_map (check_vma=True) ----------------------------------------------------------------


@on_devices
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_norm_param_grads_in_shard_map_are_device_count_invariant(kind, dtype):
    # 64 tokens: every device holds a power-of-two count (64 / D), so its tokens are a subtree of the
    # tree over tokens; plain jax.grad inside shard_map gives the single-device bits.
    x = rand((16, 4, 48), dtype, seed=1)
    w, b = rand((48,), jnp.float32, seed=2) + 1.0, rand((48,), jnp.float32, seed=3)
    loss = _norm_loss(kind)
    grads = jax.grad(loss, argnums=(0, 1, 2))
    reference = jax.jit(grads)(w, b, x)
    for d in (1, 2, 4, 8):
        m = mesh(d)
        f = jax.jit(jax.shard_map(grads, mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P("data"))))
        dw, db, dx = f(w, b, x)
        assert_bitwise(dw, reference[0], f"dscale, {d} devices")
        assert_bitwise(db, reference[1], f"dbias, {d} devices")
        assert_bitwise(dx, reference[2], f"dx, {d} devices")
        if d > 1:
            found = collectives(
                jax.shard_map(grads, mesh=m, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P("data"))), w, b, x
            )
            assert not set(found) & set(NO_SUM), found


@on_devices
@pytest.mark.parametrize("n", [300, 8200], ids=["one-segment", "two-segments"])
@pytest.mark.parametrize("mode", ["softmax", "log_softmax", "cross_entropy", "label_log_probs"])
def test_softmax_family_in_shard_map(mode, n):
    m = mesh()
    x = rand((16, 3, n), seed=4) * 3
    labels = jnp.asarray(np.random.default_rng(5).integers(0, n, (16, 3)), jnp.int32)
    fns = {
        "softmax": lambda x, lab: jaxdet.softmax(x),
        "log_softmax": lambda x, lab: jaxdet.log_softmax(x),
        "cross_entropy": jaxdet.softmax_cross_entropy_with_integer_labels,
        "label_log_probs": jaxdet.label_log_probs,
    }
    f = fns[mode]
    loss = lambda x, lab: jnp.sum(jnp.sin(f(x, lab)))
    want_out, want_dx = f(x, labels), jax.grad(loss)(x, labels)
    out = jax.jit(jax.shard_map(f, mesh=m, in_specs=(P("data"), P("data")), out_specs=P("data")))(x, labels)
    dx = jax.jit(jax.shard_map(jax.grad(loss), mesh=m, in_specs=(P("data"), P("data")), out_specs=P("data")))(x, labels)
    assert_bitwise(out, want_out)
    assert_bitwise(dx, want_dx)
    # Outputs are typed as varying: an invariant out_specs is refused, as for jnp.
    with pytest.raises(Exception, match="vary|varying|vma"):
        jax.shard_map(f, mesh=m, in_specs=(P("data"), P("data")), out_specs=P())(x, labels)


# ---- sharded jit (custom_partitioning) -----------------------------------------------------------


@on_devices
@pytest.mark.parametrize("shardy", [True, False], ids=["shardy", "gspmd"])
def test_row_ops_sharded_jit_run_per_shard(shardy):
    saved = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        m = mesh(names=("x", "y"), shape=(2, 4))
        x = rand((8, 16, 256), seed=6) * 2
        w, b = rand((256,), seed=7) + 1.0, rand((256,), seed=8)
        labels = jnp.asarray(np.random.default_rng(9).integers(0, 256, (8, 16)), jnp.int32)
        ops = {
            "rms_norm": lambda x, lab: jaxdet.rms_norm(x, w),
            "layer_norm": lambda x, lab: jaxdet.layer_norm(x, w, b),
            "softmax": lambda x, lab: jaxdet.softmax(x),
            "log_softmax": lambda x, lab: jaxdet.log_softmax(x),
            "cross_entropy": jaxdet.softmax_cross_entropy_with_integer_labels,
        }
        for spec in (P("x"), P(("x", "y")), P(None, "y"), P("x", "y")):  # any row dimensions
            xs, ls = put(x, m, spec), put(labels, m, spec)
            for name, f in ops.items():
                out = jax.jit(f)(xs, ls)
                assert_bitwise(out, f(x, labels), f"{name} {spec}")
                assert tuple(out.sharding.spec)[: len(spec)] == tuple(spec), (name, spec, out.sharding.spec)
                assert collectives(f, xs, ls) == {}, (name, spec)
                dx = jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(f(x, ls)))))(xs)
                assert_bitwise(dx, jax.grad(lambda x: jnp.sum(jnp.sin(f(x, labels))))(x), f"d{name} {spec}")
        # A split feature / class axis is all-gathered (never summed): the bits stay the same.
        xs = put(x, m, P(None, None, "y"))
        for name, f in ops.items():
            assert_bitwise(jax.jit(f)(xs, labels), f(x, labels), f"{name} split features")
            assert not set(collectives(f, xs, labels)) & set(NO_SUM), name
    finally:
        jax.config.update("jax_use_shardy_partitioner", saved)


@on_devices
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_param_grads_sharded_jit(kind):
    loss = _norm_loss(kind)
    grads = jax.grad(loss, argnums=(0, 1, 2))
    w, b = rand((40,), seed=10) + 1.0, rand((40,), seed=11)
    for tokens, aligned in ((64, True), (48, False)):
        x = rand((tokens, 40), seed=12)
        reference = grads(w, b, x)
        for d in (2, 4, 8):
            m = mesh(d)
            wd, bd, xd = put(w, m, P()), put(b, m, P()), put(x, m, P("data"))
            got = jax.jit(grads)(wd, bd, xd)
            for a, e, name in zip(got, reference, ("dscale", "dbias", "dx")):
                assert_bitwise(a, e, f"{name}, {tokens} tokens on {d} devices")
            assert got[2].sharding.spec == P("data")
            found = collectives(grads, wd, bd, xd)
            assert not set(found) & set(NO_SUM), found
            if not aligned:  # 6 tokens per device at D = 8 are not a subtree: gathered, not reduced
                assert "all-gather" in found or d < 8, found


# ---- attention (docs/attention.md, "Many devices") ------------------------------------------


def _attention_inputs():
    q = rand((8, 48, 8, 64), jnp.bfloat16, seed=20)
    k, v = rand((8, 48, 2, 64), jnp.bfloat16, seed=21), rand((8, 48, 2, 64), jnp.bfloat16, seed=22)
    w = rand((8, 48, 8, 64), seed=23)
    return q, k, v, w


def _attention_rows():
    """q_positions (reversed), kv_lengths (the first negative: no keys) and segment_ids for
    _attention_inputs' batch of 8 sequences of 48 positions."""
    q_positions = jnp.broadcast_to(jnp.arange(48, dtype=jnp.int32)[::-1], (8, 48))
    kv_lengths = jnp.arange(8, dtype=jnp.int32) * 7 - 3
    segment_ids = jnp.broadcast_to(jnp.arange(48, dtype=jnp.int32) // 13, (8, 48))
    return q_positions, kv_lengths, segment_ids


def _attention_loss(w):
    return lambda q, k, v: jnp.sum(jaxdet.attention(q, k, v).astype(jnp.float32) * w)


@on_devices
def test_attention_in_shard_map_keeps_the_unsharded_bits():
    q, k, v, w = _attention_inputs()
    m = mesh()
    want = jaxdet.attention(q, k, v)
    want_grads = jax.grad(_attention_loss(w), argnums=(0, 1, 2))(q, k, v)

    # Outputs vary like their inputs (check_vma), with the unsharded bits.
    seen = {}

    def local(q, k, v):
        out = jaxdet.attention(q, k, v)
        seen["vma"] = jax.typeof(out).mat.varying
        return out

    out = jax.shard_map(local, mesh=m, in_specs=P("data"), out_specs=P("data"))(q, k, v)
    assert seen["vma"] == frozenset({"data"}), seen
    assert_bitwise(out, want)

    # jax.grad inside shard_map, every operand split over the batch.
    def local_grads(q, k, v, w):
        return jax.grad(_attention_loss(w), argnums=(0, 1, 2))(q, k, v)

    grads = jax.shard_map(local_grads, mesh=m, in_specs=P("data"), out_specs=P("data"))(q, k, v, w)
    for got, expected, name in zip(grads, want_grads, ("dq", "dk", "dv")):
        assert_bitwise(got, expected, name)

    # Keys and values invariant (shared by all devices), queries split over the batch: their
    # gradients are the canonical tree over the devices' float32 cotangents, typed invariant.
    def shared(q, k, v, w):
        def b(x):
            return jnp.broadcast_to(x, (q.shape[0],) + x.shape[1:])

        return jnp.sum(jaxdet.attention(q, b(k), b(v)).astype(jnp.float32) * w)

    def local_kv(q, k, v, w):
        return jax.grad(shared, argnums=(1, 2))(q, k, v, w)

    specs = (P("data"), P(), P(), P("data"))
    dk, dv = jax.shard_map(local_kv, mesh=m, in_specs=specs, out_specs=P())(q, k[:1], v[:1], w)
    rk, rv = jax.grad(shared, argnums=(1, 2))(q, k[:1], v[:1], w)
    for got, expected in ((dk, rk), (dv, rv)):
        got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-2


@on_devices
def test_attention_in_shard_map_every_row_form():
    # The lengths form (not causal; a negative length is none), packed segments, a mask and a
    # sliding window, split with the batch inside jax.shard_map: the forward and jax.grad keep the
    # unsharded bits.
    q, k, v, w = _attention_inputs()
    m = mesh()
    _, kv_lengths, segment_ids = _attention_rows()
    forms = {
        "lengths": (lambda q, k, v, rows: jaxdet.attention(q, k, v, causal=False, kv_lengths=rows), kv_lengths),
        "segments": (lambda q, k, v, rows: jaxdet.attention(q, k, v, segment_ids=rows), segment_ids),
        # a per-sequence left-padding mask [B, 1, 1, S] (sequence b starts at key b), and a window
        "mask": (
            lambda q, k, v, rows: jaxdet.attention(q, k, v, mask=rows),
            (jnp.arange(48)[None, :] >= jnp.arange(8)[:, None])[:, None, None, :],
        ),
        "window": (lambda q, k, v, rows: jaxdet.attention(q, k, v, q_positions=rows, window=9), _attention_rows()[0]),
    }
    for name, (form, rows) in forms.items():

        def loss(q, k, v, rows, w, form=form):
            return jnp.sum(form(q, k, v, rows).astype(jnp.float32) * w)

        grads = jax.grad(loss, argnums=(0, 1, 2))
        out = jax.shard_map(form, mesh=m, in_specs=P("data"), out_specs=P("data"))(q, k, v, rows)
        assert_bitwise(out, form(q, k, v, rows), name)
        got = jax.shard_map(grads, mesh=m, in_specs=P("data"), out_specs=P("data"))(q, k, v, rows, w)
        for a, e, g in zip(got, grads(q, k, v, rows, w), ("dq", "dk", "dv")):
            assert_bitwise(a, e, f"{name} {g}")


@on_devices
def test_attention_sharded_jit_runs_per_shard():
    q, k, v, w = _attention_inputs()
    m = mesh()
    want = jaxdet.attention(q, k, v)

    def attend(q, k, v):
        return jaxdet.attention(q, k, v)

    # Batch or query rows split: no collective, the unsharded bits.
    for spec, kv_spec in ((P("data"), P("data")), (P(None, "data"), P())):
        args = [put(q, m, spec), put(k, m, kv_spec), put(v, m, kv_spec)]
        assert_bitwise(jax.jit(attend)(*args), want, f"{spec}")
        assert collectives(attend, *args) == {}, (spec, collectives(attend, *args))
    # Each form of the rows' description (jaxdet/_src/attention/attention.py): positions and lengths split with
    # the batch (and positions with the query rows), segment starts and limits likewise. (Segment
    # starts are a running maximum along the query rows: split rows need collectives to find
    # them, before the attention.)
    q_positions, kv_lengths, segment_ids = _attention_rows()
    forms = {
        "lengths": lambda q, k, v, p, n, s: jaxdet.attention(q, k, v, causal=False, kv_lengths=n),
        "positions": lambda q, k, v, p, n, s: jaxdet.attention(q, k, v, q_positions=p, kv_lengths=n),
        "segments": lambda q, k, v, p, n, s: jaxdet.attention(q, k, v, segment_ids=s),
    }
    for name, form in forms.items():
        expected = form(q, k, v, q_positions, kv_lengths, segment_ids)
        for spec, kv_spec, row_spec in ((P("data"), P("data"), P("data")), (P(None, "data"), P(), P(None, "data"))):
            args = [put(x, m, sp) for x, sp in ((q, spec), (k, kv_spec), (v, kv_spec))]
            args += [put(q_positions, m, row_spec), put(kv_lengths, m, P(*row_spec[:1])), put(segment_ids, m, row_spec)]
            assert_bitwise(jax.jit(form)(*args), expected, f"{name} {spec}")
            if name != "segments" or spec == P("data"):
                assert collectives(form, *args) == {}, (name, spec, collectives(form, *args))
    # The gradient under sharded jit, batch split.
    grads = jax.grad(_attention_loss(w), argnums=(0, 1, 2))
    args = [put(x, m, P("data")) for x in (q, k, v)]
    for got, expected, name in zip(jax.jit(grads)(*args), grads(q, k, v), ("dq", "dk", "dv")):
        assert_bitwise(got, expected, name)


# ---- forward mode (docs/derivatives.md) ----------------------------------------------------------


@on_devices
def test_tangents_in_shard_map_and_sharded_jit_equal_one_device():
    m = mesh()
    x, w, tx, tw = rand((16, 32), seed=0), rand((32,), seed=1), rand((16, 32), seed=2), rand((32,), seed=3)
    b = rand((32, 8), seed=4)

    def tangents(x, w, tx, tw):
        t_norm = jax.jvp(lambda x, w: jaxdet.rms_norm(x, w), (x, w), (tx, tw))[1]
        t_mm = jax.jvp(lambda x: jaxdet.matmul(x, b), (x,), (tx,))[1]
        t_sm = jax.jvp(jaxdet.log_softmax, (x,), (tx,))[1]
        return t_norm, t_mm, t_sm

    want = tangents(x, w, tx, tw)
    sm = jax.jit(jax.shard_map(tangents, mesh=m, in_specs=(P("data"), P(), P("data"), P()), out_specs=(P("data"),) * 3))
    for got, exp in zip(sm(put(x, m, P("data")), w, put(tx, m, P("data")), tw), want):
        assert_bitwise(got, exp)
    sharded = jax.jit(tangents)(put(x, m, P("data")), w, put(tx, m, P("data")), tw)
    for got, exp in zip(sharded, want):
        assert_bitwise(got, exp)


@on_devices
@pytest.mark.parametrize("blocks", [False, True], ids=["one_block", "query_blocks"])
def test_attention_tangents_in_shard_map_and_sharded_jit_equal_one_device(blocks, monkeypatch):
    # Sequences split over the devices: a tangent (and a Hessian-vector product in q) has the
    # single-device bits, inside shard_map (every operand split, or keys and values shared) and
    # under sharded jit; with `blocks`, the tangent in blocks of query positions (a sequence per
    # device: 3 blocks of 6 positions; the whole batch: 16 blocks of 1) has the one-block bits.
    m = mesh()
    q, k, v = rand((8, 16, 4, 32), seed=30), rand((8, 16, 2, 32), seed=31), rand((8, 16, 2, 32), seed=32)
    tq, tk, tv = rand(q.shape, seed=33), rand(k.shape, seed=34), rand(v.shape, seed=35)
    kv_lengths = jnp.arange(8, dtype=jnp.int32) * 3 - 2  # the first sequence sees no key

    def tangents(q, k, v, tq, tk, tv, n):
        f = (
            lambda q, k, v: jaxdet.attention(  # noqa: E731
                q,
                jnp.broadcast_to(k, (q.shape[0],) + k.shape[1:]),
                jnp.broadcast_to(v, (q.shape[0],) + v.shape[1:]),
                kv_lengths=n,
            )
        )
        loss = lambda q: jnp.sum(jnp.sin(2.0 * f(q, k, v)))  # noqa: E731
        return jax.jvp(f, (q, k, v), (tq, tk, tv))[1], jax.jvp(jax.grad(loss), (q,), (tq,))[1]

    want_split = tangents(q, k, v, tq, tk, tv, kv_lengths)
    want_shared = tangents(q, k[:1], v[:1], tq, tk[:1], tv[:1], kv_lengths)
    if blocks:
        from jaxdet._src.attention import attention as module

        # 6 query positions' float32 scores of one sequence [1, 2 KV heads, 6 * 2, 16 keys].
        monkeypatch.setattr(module, "TANGENT_BLOCK_BYTES", 1 * 4 * 16 * 4 * 6)
    split = P("data")
    sm = jax.jit(jax.shard_map(tangents, mesh=m, in_specs=split, out_specs=split))
    for got, exp, name in zip(sm(q, k, v, tq, tk, tv, kv_lengths), want_split, ("tangent", "hvp")):
        assert_bitwise(got, exp, f"shard_map: {name}")
    # Keys, values and their tangents shared by every device.
    shared = (split, P(), P(), split, P(), P(), split)
    sm = jax.jit(jax.shard_map(tangents, mesh=m, in_specs=shared, out_specs=split))
    for got, exp, name in zip(sm(q, k[:1], v[:1], tq, tk[:1], tv[:1], kv_lengths), want_shared, ("tangent", "hvp")):
        assert_bitwise(got, exp, f"shard_map, shared keys: {name}")
    args = [put(x, m, split) for x in (q, k, v, tq, tk, tv, kv_lengths)]
    for got, exp, name in zip(jax.jit(tangents)(*args), want_split, ("tangent", "hvp")):
        assert_bitwise(got, exp, f"sharded jit: {name}")
