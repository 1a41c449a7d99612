"""jaxdet.audit: every hazard is found with its source line, inside nested jaxprs too; a model
built from jaxdet ops is clean (docs/audit.md)."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxdet
from jaxdet._src.audit.audit import BATCH, DEVICES, RUN, AuditReport, Finding

_SOURCE = pathlib.Path(__file__).read_text().splitlines()


def line_of(tag: str) -> int:
    """The line of this file that carries the comment `# <tag>`."""
    hits = [i + 1 for i, text in enumerate(_SOURCE) if text.rstrip().endswith(f"# <{tag}>")]
    assert len(hits) == 1, tag
    return hits[0]


def at(report: AuditReport, tag: str) -> list[Finding]:
    line = line_of(tag)
    return [f for f in report.findings if f.line == line and f.file == __file__]


X = jnp.ones((8, 32), jnp.float32)
W = jnp.ones((32, 16), jnp.float32)
KEY = jax.random.key(0)


# ---- Models that each have one problem. ----


def model_dot(x, w):
    return jnp.dot(x, w)  # <dot>


def model_jax_dropout(x, key):
    keep = jax.random.bernoulli(key, 0.9, x.shape)  # <bernoulli>
    return jnp.where(keep, x / 0.9, 0.0)


def model_scatter_add(ids, x):
    return jnp.zeros((5, x.shape[1]), x.dtype).at[ids].add(x)  # <scatter>


def model_embedding(table, ids):
    return table[ids]  # <embedding>


def model_attention(q):
    return jax.nn.dot_product_attention(q, q, q, is_causal=True)  # <attention>


def model_softmax(x):
    return jax.nn.softmax(x) * jnp.arange(x.shape[-1], dtype=x.dtype)  # <softmax>


def model_batch_sum(x):
    return jnp.sum(x * x, axis=0)  # <batch-sum>


def model_rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)  # <rms>


def test_jnp_dot_is_flagged_with_its_line():
    report = jaxdet.audit(model_dot, X, W, batch_argnums=0)
    assert not report.ok
    (f,) = at(report, "dot")
    assert (f.kind, f.primitive, f.breaks) == ("dot", "dot_general", (BATCH,))
    assert "f32[8,32] x f32[32,16] -> f32[8,16]" == f.shapes
    assert "jaxdet.matmul" in f.fix
    assert f"test_audit.py:{line_of('dot')}" in str(report)


def test_jax_random_dropout_is_flagged():
    report = jaxdet.audit(model_jax_dropout, X, KEY, batch_argnums=0)
    (f,) = at(report, "bernoulli")
    assert f.kind == "rng" and f.primitive == "random_bits" and f.breaks == (BATCH,)
    assert "jaxdet.dropout" in f.fix and f.origin == "jax.random.bernoulli"
    assert "jit(_bernoulli)" in f.path  # found inside jax's nested jit


def test_xla_rng_bit_generator_is_flagged():
    def fn(x, key):
        _, bits = jax.lax.rng_bit_generator(key, x.shape)  # <rbg>
        return x * (bits > jnp.uint32(2**31))

    report = jaxdet.audit(fn, X, jnp.zeros((4,), jnp.uint32), batch_argnums=0)
    (f,) = at(report, "rbg")
    assert f.kind == "rng" and f.primitive == "rng_bit_generator" and "per backend" in f.why


def test_scatter_add_is_flagged():
    ids = jnp.array([0, 1, 1, 2, 3, 0, 1, 2])
    report = jaxdet.audit(model_scatter_add, ids, X, batch_argnums=(0, 1))
    (f,) = at(report, "scatter")
    assert f.kind == "scatter" and f.primitive == "scatter-add" and f.breaks == (DEVICES,)
    gpu = jaxdet.audit(model_scatter_add, ids, X, batch_argnums=(0, 1), backend="gpu")
    (g,) = at(gpu, "scatter")
    assert RUN in g.breaks and "atomics" in g.why and "--xla_gpu_deterministic_ops=true" in g.fix


def test_embedding_gradient_scatter_add_is_flagged_in_the_backward():
    table = jnp.ones((50, 16))
    ids = jnp.arange(8) % 50
    grad = jax.grad(lambda t, i: jnp.sum(model_embedding(t, i) ** 2))
    report = jaxdet.audit(grad, table, ids, batch_argnums=1)
    found = at(report, "embedding")
    assert [(f.kind, f.primitive, f.backward) for f in found] == [("scatter", "scatter-add", True)]
    assert "jaxdet.embed" in found[0].fix


def test_dot_product_attention_is_flagged():
    q = jnp.ones((2, 16, 4, 8), jnp.float32)
    report = jaxdet.audit(model_attention, q, batch_argnums=0)
    found = at(report, "attention")
    kinds = sorted(f.kind for f in found)
    assert kinds.count("attention") == 2  # QKᵀ and PV (implementation 'xla' on this backend)
    assert all(f.origin == "jax.nn.dot_product_attention" for f in found)
    assert all("jaxdet.matmul for QKᵀ and PV" in f.fix for f in found)  # the softmax's reduction too


@pytest.mark.gpu
def test_gpu_cudnn_attention_custom_call_is_flagged(gpu):
    q = jnp.ones((2, 128, 4, 64), jnp.bfloat16)
    attn = functools.partial(jax.nn.dot_product_attention, implementation="cudnn")
    report = jaxdet.audit(jax.grad(lambda q: jnp.sum(attn(q, q, q).astype(jnp.float32))), q, batch_argnums=0)
    prims = {f.primitive for f in report.findings if f.kind == "attention"}
    assert any(p.startswith("dot_product_attention") for p in prims), str(report)
    assert all(RUN in f.breaks for f in report.findings if f.kind == "attention")


def test_psum_inside_shard_map_is_flagged():
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(X, jax.sharding.NamedSharding(mesh, P("d")))

    def step(x):
        return jax.shard_map(lambda y: jax.lax.psum(y, "d"), mesh=mesh, in_specs=P("d"), out_specs=P())(x)  # <psum>

    report = jaxdet.audit(step, x)
    (f,) = at(report, "psum")
    assert f.kind == "collective" and f.breaks == (DEVICES,) and "shard_map" in f.path
    assert "jaxdet.parallel.tree_psum" in f.fix

    def scatter_step(x):
        def body(y):
            return jax.lax.psum_scatter(y, "d", tiled=True)  # <psum-scatter>

        return jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(x)

    assert [(f.kind, f.primitive) for f in at(jaxdet.audit(scatter_step, x), "psum-scatter")] == [
        ("collective", "reduce_scatter")
    ]


def test_softmax_backward_is_flagged():
    grad = jax.grad(lambda x: jnp.sum(model_softmax(x)))
    report = jaxdet.audit(grad, X, batch_argnums=0)
    found = at(report, "softmax")
    backward = [f for f in found if f.kind == "softmax-backward"]
    assert backward and all(f.backward and f.breaks == (BATCH,) for f in backward)
    assert all(f.fix.startswith("jaxdet.softmax(x)") for f in found)
    gpu = jaxdet.audit(grad, X, batch_argnums=0, backend="gpu")
    assert all(RUN in f.breaks for f in gpu.findings if f.kind == "softmax-backward")


def test_sum_over_the_batch_is_a_cross_row_reduction():
    report = jaxdet.audit(model_batch_sum, X, batch_argnums=0)
    (f,) = at(report, "batch-sum")
    assert f.kind == "reduce" and f.breaks == (DEVICES,) and "across rows: axis 0" in f.why
    # Without batch_argnums the audit cannot tell the rows: both hazards are listed.
    (g,) = at(jaxdet.audit(model_batch_sum, X), "batch-sum")
    assert g.breaks == (BATCH, DEVICES)


def test_row_reduction_is_within_rows_and_names_the_jaxdet_op():
    report = jaxdet.audit(model_rms_norm, X, batch_argnums=0)
    (f,) = at(report, "rms")
    assert f.breaks == (BATCH,) and "within rows: the batch is axis 0" in f.why
    assert f.fix.startswith("jaxdet.rms_norm") and f.origin == "jnp.mean"


def test_library_layers_name_their_jaxdet_replacement():
    optax = pytest.importorskip("optax")
    labels = jnp.zeros((8,), jnp.int32)
    report = jaxdet.audit(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels), X, batch_argnums=0)
    assert report.findings and all(f.origin == "optax.softmax_cross_entropy_with_integer_labels" for f in report)
    assert all(f.fix.startswith("jaxdet.softmax_cross_entropy") for f in report)
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.RMSNorm()(nn.LayerNorm()(nn.Dense(16)(x)))  # <flax>

    params = Block().init(jax.random.key(0), X)
    found = {f.origin: f.fix for f in at(jaxdet.audit(Block().apply, params, X, batch_argnums=1), "flax")}
    assert found["flax:Dense"].startswith("jaxdet.matmul")
    assert found["flax:LayerNorm"].startswith("jaxdet.layer_norm")
    assert found["flax:RMSNorm"].startswith("jaxdet.rms_norm")


def test_optimizer_reductions_over_parameters_are_not_batch_hazards():
    optax = pytest.importorskip("optax")
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def step(w, state, x):
        g = jax.grad(lambda w: jnp.sum(jaxdet.matmul(x, w) ** 2))(w)
        updates, state = opt.update(g, state, w)
        return optax.apply_updates(w, updates), state

    report = jaxdet.audit(step, W, opt.init(W), X, batch_argnums=2)
    assert report.ok and not report.findings, str(report)
    # Under GPU rules only a long reduction would be reported (run-to-run); this one is short.
    assert jaxdet.audit(step, W, opt.init(W), X, batch_argnums=2, backend="gpu").ok


# ---- Nested jaxprs: scan, remat, custom_vjp, while/cond, shard_map (above). ----


def test_findings_inside_scan_and_remat_bodies():
    def step(xs, w):
        def body(carry, x):
            return carry + jnp.dot(x, w), None  # <scan-dot>

        out, _ = jax.lax.scan(body, jnp.zeros((8, 16)), xs)
        return jax.checkpoint(lambda o: jnp.dot(o, w.T))(out)  # <remat-dot>

    # xs is [steps, rows, features]: its leading axis is not the batch, so no batch_argnums.
    report = jaxdet.audit(step, jnp.ones((3, 8, 32)), W)
    (s,) = at(report, "scan-dot")
    assert "scan" in s.path
    (r,) = at(report, "remat-dot")
    assert "checkpoint" in r.path or "remat" in r.path
    # The backward of both bodies is audited through jax.grad.
    grad = jaxdet.audit(jax.grad(lambda xs, w: jnp.sum(step(xs, w))), jnp.ones((3, 8, 32)), W)
    assert any(f.backward for f in at(grad, "scan-dot")) and any(f.backward for f in at(grad, "remat-dot"))


@jax.custom_vjp
def custom_op(x, w):
    return jnp.dot(x, w)  # <vjp-primal>


def _custom_fwd(x, w):
    return jnp.dot(x, w), (x, w)  # <vjp-fwd>


def _custom_bwd(res, g):
    x, w = res
    return g @ w.T, jnp.sum(x[:, :, None] * g[:, None, :], axis=0)


custom_op.defvjp(_custom_fwd, _custom_bwd)


def custom_loss(x, w):
    return jnp.sum(custom_op(x, w) ** 2)  # <vjp-call>


def test_findings_inside_custom_vjp_forward_and_backward():
    fwd = jaxdet.audit(custom_op, X, W)
    assert at(fwd, "vjp-primal") and "custom_vjp" in at(fwd, "vjp-primal")[0].path
    grad = jaxdet.audit(jax.grad(custom_loss, argnums=(0, 1)), X, W, batch_argnums=0)
    assert at(grad, "vjp-fwd")  # the forward rule, which runs under differentiation
    # JAX records the backward rule's equations with the source of the call they differentiate.
    kinds = {(f.kind, f.breaks, f.backward) for f in at(grad, "vjp-call")}
    assert ("dot", (BATCH,), True) in kinds  # g @ w.T: rows
    assert ("reduce", (DEVICES,), True) in kinds  # dW summed over rows


def test_generic_and_windowed_reductions_are_flagged():
    def fn(x):
        a = jax.lax.reduce(x, 0.0, lambda u, v: u + v, (1,))  # <lax-reduce>
        b = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 4), (1, 1), "VALID")  # <window>
        return a + b[:, 0]

    report = jaxdet.audit(fn, X, batch_argnums=0)
    assert [(f.kind, f.primitive, f.breaks) for f in at(report, "lax-reduce")] == [("reduce", "reduce", (BATCH,))]
    assert [f.primitive for f in at(report, "window")] == ["reduce_window_sum"]


def test_findings_inside_while_and_cond():
    def step(x, w):
        x = jax.lax.cond(x[0, 0] > 0, lambda v: jnp.dot(v, w), lambda v: v[:, :16], x)  # <cond-dot>
        return jax.lax.while_loop(lambda v: v[0, 0] < 10, lambda v: v + jnp.sum(v, 1, keepdims=True), x)  # <while>

    report = jaxdet.audit(step, X, W, batch_argnums=0)
    assert "cond" in at(report, "cond-dot")[0].path
    assert at(report, "while")[0].kind == "reduce" and "while" in at(report, "while")[0].path


# ---- A model of jaxdet ops only is clean, forward and backward. ----


def jaxdet_model(params, x, key, first_row=None):
    """first_row: the global index of x's first row (a traced offset places each row's mask); None:
    one key per example."""
    h = jax.nn.gelu(jaxdet.matmul(x, params["w1"]))
    if first_row is None:
        keys = jax.vmap(lambda i: jaxdet.random.fold_in(key, i))(jnp.arange(h.shape[0]))
        h = jax.vmap(lambda r, k: jaxdet.dropout(r, k, 0.1))(h, keys)
    else:
        h = jaxdet.dropout(h, key, 0.1, offset=first_row * h.shape[1])
    return jaxdet.matmul(h, params["w2"]) + params["b"]


def test_dropout_with_one_key_for_the_batch_is_a_batch_hazard():
    """One key for a batch-shaped array: a row's mask follows its position in the batch. An offset
    by the global example index (traced) or one key per example makes it invariant."""
    params = {"w1": jnp.ones((32, 64)), "w2": jnp.ones((64, 16)), "b": jnp.zeros((16,))}
    key = jaxdet.random.key(1)

    def shared(params, x, key):
        h = jaxdet.dropout(jax.nn.gelu(jaxdet.matmul(x, params["w1"])), key, 0.1)
        return jaxdet.matmul(h, params["w2"])

    report = jaxdet.audit(shared, params, X, key, batch_argnums=1)
    found = [f for f in report.findings if f.primitive == "jaxdet_dropout"]
    assert len(found) == 1 and found[0].breaks == (BATCH,) and "offset" in found[0].fix, str(report)
    for first_row in (None, jnp.uint32(64)):
        clean = jaxdet.audit(jaxdet_model, params, X, key, first_row, batch_argnums=1, strict=True)
        assert clean.ok and not clean.findings, str(clean)


def test_jaxdet_model_is_clean():
    params = {"w1": jnp.ones((32, 64)), "w2": jnp.ones((64, 16)), "b": jnp.zeros((16,))}
    key = jaxdet.random.key(1)

    def train_step(params, x, key):
        grads = jax.grad(lambda p: jnp.sum(jaxdet_model(p, x, key)))(params)
        grads = {k: v for k, v in grads.items() if k != "b"}  # the bias gradient is a cross-row sum
        grads, _ = jaxdet.clip_by_global_norm(grads, 1.0)
        return jax.tree.map(lambda p, g: p - 0.1 * g, {k: params[k] for k in grads}, grads)

    for kw in ({}, {"batch_argnums": 1}, {"backend": "gpu", "batch_argnums": 1}):
        report = jaxdet.audit(train_step, params, X, key, strict=True, **kw)
        assert report.ok and not report.findings, str(report)
    fwd = jaxdet.audit(jaxdet_model, params, X, key, batch_argnums=1, strict=True)
    assert fwd.ok and not fwd.findings, str(fwd)


def test_bias_gradient_is_a_cross_row_sum():
    params = {"w1": jnp.ones((32, 64)), "w2": jnp.ones((64, 16)), "b": jnp.zeros((16,))}
    grad = jax.grad(lambda p, x: jnp.sum(jaxdet_model(p, x, jaxdet.random.key(1))))
    report = jaxdet.audit(grad, params, X, batch_argnums=1)
    assert [(f.kind, f.breaks, f.backward) for f in report.findings] == [("reduce", (DEVICES,), True)]
    assert report.findings[0].function == "jaxdet_model"


# ---- Precision: what is not a hazard. ----


def test_exact_and_batch_independent_ops_are_not_flagged():
    def fn(x, w, ids):
        count = jnp.sum((ids > 2).astype(jnp.int32))  # integer sum: exact
        decay = jnp.sum(w * w)  # over the parameters only: no batch axis
        pair = jnp.sum(x[:, :2], axis=1)  # two terms: exact in any order
        outer = x[:, :1] * w[0][None, :]  # elementwise
        top = jnp.max(x, axis=1) + jnp.argmax(x, axis=1)  # exact reductions
        top = top + jax.lax.reduce(x, -jnp.inf, jax.lax.max, (1,))  # a max through lax.reduce
        return count + decay + pair + outer[:, 0] + top

    ids = jnp.arange(8)
    report = jaxdet.audit(fn, X, W, ids, batch_argnums=(0, 2))
    assert report.ok and not report.findings, str(report)
    # Without batch axes, the parameter sum cannot be told apart from a batch reduction.
    assert [f.primitive for f in jaxdet.audit(fn, X, W, ids).findings] == ["reduce_sum"]


def test_gpu_long_batch_independent_reduction_is_a_run_to_run_hazard():
    w = jnp.ones((4, 40000))
    report = jaxdet.audit(
        lambda x, w: x[:, :4] @ jnp.ones((4, 4)) + jnp.sum(w), X, w, batch_argnums=0, backend="gpu", ignore="dot"
    )
    (f,) = report.findings
    assert f.breaks == (RUN,) and "race-free bound" in f.why and "--xla_gpu_deterministic_ops=true" in f.fix
    assert jaxdet.audit(lambda x, w: jnp.sum(w) + x, X, w, batch_argnums=0, backend="cpu").ok


# ---- Options. ----


def test_ignore_by_kind_primitive_location_and_callable():
    def fn(x, w, key):
        return model_dot(x, w) + model_jax_dropout(x, key)[:, :16]

    full = jaxdet.audit(fn, X, W, KEY, batch_argnums=0)
    assert {f.kind for f in full.findings} == {"dot", "rng"}
    assert jaxdet.audit(fn, X, W, KEY, batch_argnums=0, ignore=["dot", "rng"]).ok
    assert jaxdet.audit(fn, X, W, KEY, batch_argnums=0, ignore=["dot_general", "random_bits"]).ok
    loc = f"test_audit.py:{line_of('dot')}"
    only_rng = jaxdet.audit(fn, X, W, KEY, batch_argnums=0, ignore=loc)
    assert {f.kind for f in only_rng.findings} == {"rng"} and [f.kind for f in only_rng.ignored] == ["dot"]
    assert jaxdet.audit(fn, X, W, KEY, batch_argnums=0, ignore=lambda f: True).ok
    assert jaxdet.audit(fn, X, W, KEY, batch_argnums=0, ignore="test_audit.py").ok


def test_strict_fails_on_what_the_audit_cannot_see():
    def fn(x):
        y = jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x)  # <callback>
        return y + 1

    report = jaxdet.audit(fn, X)
    (f,) = at(report, "callback")
    assert f.kind == "unverified" and not f.blocking and report.ok
    strict = jaxdet.audit(fn, X, strict=True)
    assert not strict.ok and at(strict, "callback")[0].blocking


def test_a_pallas_kernel_is_one_unverified_note_not_its_inner_ops():
    from jax.experimental import pallas as pl

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

    def fn(x, w):
        out = jax.ShapeDtypeStruct((8, 16), jnp.float32)
        return pl.pallas_call(kernel, out_shape=out, interpret=True)(x, w)  # <pallas>

    report = jaxdet.audit(fn, X, W)
    assert [(f.kind, f.primitive, f.blocking) for f in report.findings] == [("unverified", "pallas_call", False)]
    assert at(report, "pallas") and report.ok and not jaxdet.audit(fn, X, W, strict=True).ok


def test_invariants_select_what_is_audited():
    fn = lambda x: model_batch_sum(x) + model_rms_norm(x)[0]  # noqa: E731
    full = jaxdet.audit(fn, X, batch_argnums=0)
    assert {f.breaks for f in full.findings} == {(DEVICES,), (BATCH,)}
    inference = jaxdet.audit(fn, X, batch_argnums=0, invariants=("batch", "run-to-run"))
    assert [f.breaks for f in inference.findings] == [(BATCH,)]


def test_gpu_rules_on_a_cpu_machine():
    report = jaxdet.audit(model_dot, X, W, batch_argnums=0, backend="gpu")
    (f,) = at(report, "dot")
    assert f.breaks == (BATCH, RUN) and "autotuner" in f.why and report.backend == "gpu"


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="backend must be 'cpu' or 'gpu'"):
        jaxdet.audit(model_dot, X, W, backend="tpu")
    with pytest.raises(ValueError, match="batch_argnums must index"):
        jaxdet.audit(model_dot, X, W, batch_argnums=2)
    with pytest.raises(TypeError, match="ignore must be"):
        jaxdet.audit(model_dot, X, W, ignore=3)
    with pytest.raises(ValueError, match="invariants must be"):
        jaxdet.audit(model_dot, X, W, invariants=("speed",))
    with pytest.raises(TypeError, match="fn must be callable"):
        jaxdet.audit(3, X)
    with pytest.raises(TypeError, match="strict must be a bool"):
        jaxdet.audit(model_dot, X, W, strict="yes")


def test_report_is_usable_in_ci():
    report = jaxdet.audit(model_dot, X, W)
    text = str(report)
    assert text.startswith("jaxdet.audit (cpu): NOT OK, 1 finding(s), 1 blocking")
    assert "why:" in text and "fix:" in text and len(report) == 1 and list(report) == list(report.findings)
    clean = jaxdet.audit(lambda x: x * 2, X, batch_argnums=0)
    assert clean.ok and str(clean).startswith("jaxdet.audit (cpu): OK, 0 finding(s)")


def test_shape_dependent_function_falls_back_to_unknown_batch_axes():
    # This function only traces at batch 8: the doubled trace fails, so every reduction is reported.
    def fn(x):
        return jnp.sum(x.reshape(8, 32), axis=1)

    report = jaxdet.audit(fn, X, batch_argnums=0)
    assert not report.batch_axes and report.findings[0].breaks == (BATCH, DEVICES)


def test_nnx_in_place_step_is_audited_whole():
    """The standard in-place NNX step returns only the loss; the optimizer's update (and the
    backward feeding it: the embedding's scatter-add among it) is audited too."""
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(50, 8, rngs=rngs)
            self.out = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, t):
            return self.out(jnp.tanh(self.embed(t)))

    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)

    def step(model, optimizer, t):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(t) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    report = jaxdet.audit(step, model, optimizer, jnp.ones((4, 6), jnp.int32))
    prims = {f.primitive for f in report.findings if f.backward}
    assert "scatter-add" in prims and "dot_general" in prims, str(report)
    assert all("jaxdet.invariant" in f.fix for f in report.findings if f.primitive != "jaxdet_dropout")
