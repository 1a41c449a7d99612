"""Every CUDA handler that declares command-buffer compatibility runs inside XLA's command buffers.

A CUDA handler is compatible when, while it runs, it only enqueues work on the stream XLA hands it
(kernels, cudaMemsetAsync, device-to-device cudaMemcpyAsync): no host synchronisation, allocation,
event or stream query, host read of device data or scratch allocator, and nothing that depends on
more than its buffers and attributes. Such a handler says so with `{ffi::Traits::kCmdBufferCompatible}`
as the last argument of its XLA_FFI_DEFINE_HANDLER_SYMBOL; one that is not carries the comment
`// Not command-buffer compatible: <reason>` right above its definition.

* CPU: the CUDA sources (`cuda/*/*_cuda.cu`, mapped to target names as `cuda/module.cc` registers
  them; `_native.cuda_targets()` is empty on a CPU-only build) hold no handler that does neither,
  and every compatible target is one that the GPU test below runs (so a new handler cannot be
  missed); each GPU case, compiled for the CPU, calls the targets it names.
* GPU: for each case (a jitted function and, where the primitive has a backward, its gradient),
  every custom call of the compiled module runs inside a command buffer, the named targets among
  them, and three runs (the first records the graph, so a handler's one-time set-up happens while
  XLA captures it; the others replay it) give the bits of the same module compiled without command
  buffers (tests/command_buffers.py).
"""

from __future__ import annotations

import pathlib
import re

import command_buffers
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdet
from jaxdet import _native

ROOT = pathlib.Path(__file__).resolve().parent.parent
CUDA_SOURCES = sorted((ROOT / "cuda").glob("*/*_cuda.cu"))
MODULE_CC = ROOT / "cuda" / "module.cc"
COMPATIBLE = "ffi::Traits::kCmdBufferCompatible"
NOT_COMPATIBLE = "Not command-buffer compatible:"

F32, BF16 = jnp.float32, jnp.bfloat16


def _rand(shape, dtype=F32, seed=0, scale=1.0):
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale
    return np.asarray(x, dtype=dtype)


def _loss(y):
    return jnp.sum(jnp.square(y.astype(F32)))


# ---- The cases: name -> (targets, build); build() -> (fn, numpy args). Every function calls its
# custom calls several times with fusions between (sequences that XLA would put in command buffers
# even at its default minimum of 5 commands). ----


def _philox():
    # The raw block function through its FFI target (the public API derives keys with it).
    def philox(counters, key):
        return jax.ffi.ffi_call("jaxdet_philox4x32_10", jax.ShapeDtypeStruct(counters.shape, jnp.uint32))(counters, key)

    def fn(counters, key):
        outs = []
        for _ in range(4):
            counters = philox(counters, key)
            outs.append(counters)
            counters = counters ^ jnp.uint32(0x9E3779B9)
        return outs

    counters = np.arange(4 * 1000, dtype=np.uint32).reshape(1000, 4)
    return fn, (counters, np.asarray(jaxdet.random.key(7)))


def _dropout():
    def loss(x, key):
        y = x
        for i in range(3):
            y = jnp.tanh(jaxdet.dropout(y, key, 0.25, offset=1000 * i + 3))
        y = jaxdet.dropout(y, key, 0.5, broadcast_dims=(0,))  # the strided mask's kernel
        return _loss(y)

    x = _rand((8, 1029), BF16, seed=1)
    return jax.value_and_grad(loss), (x, np.asarray(jaxdet.random.key(11)))


def _matmul():
    def loss(x, ws):
        for w in ws:
            x = jnp.tanh(jaxdet.matmul(x, w))
        return _loss(x)

    x = _rand((16, 256), BF16, seed=2)
    ws = [_rand((256, 256), BF16, seed=3 + i, scale=1 / 16) for i in range(3)]
    return jax.value_and_grad(loss, argnums=(0, 1)), (x, ws)


def _matmul_weight_grad():
    def fn(x, dc):
        acc = jaxdet.matmul_weight_grad(x, dc)
        for _ in range(4):
            acc = jaxdet.matmul_weight_grad(x, dc, acc)
        return acc

    return fn, (_rand((64, 256), BF16, seed=4), _rand((64, 128), BF16, seed=5))


def _leaves(seed):
    return [
        _rand((3, 4096), F32, seed=seed),
        _rand((5000,), BF16, seed=seed + 1),
        _rand((17, 33), jnp.float16, seed=seed + 2),
        _rand((), F32, seed=seed + 3),
    ]


def _global_norm():
    def fn(leaves):
        norms = []
        for _ in range(3):
            n = jaxdet.global_norm(leaves)
            norms.append(n)
            leaves = [jnp.tanh(x * (n / 64).astype(x.dtype)) for x in leaves]
        return norms

    return fn, (_leaves(6),)


def _clip_by_global_norm():
    def fn(leaves):
        out = []
        for max_norm, nonfinite in ((1.0, "propagate"), (1e9, "propagate"), (2.0, "skip")):
            leaves, n = jaxdet.clip_by_global_norm(leaves, max_norm, nonfinite=nonfinite)
            out.append(n)
            leaves = [jnp.tanh(x) * 3 for x in leaves]
        return leaves, out

    return fn, (_leaves(10),)


def _clip_staged():
    # Under vmap each example is clipped by its own norm: the staged targets (partials with and
    # without the leaves handed on, finalize, apply).
    def fn(leaves, max_norm):
        norms = jax.vmap(jaxdet.global_norm)(leaves)
        clipped, n = jax.vmap(lambda t, m: jaxdet.clip_by_global_norm(t, m))(leaves, max_norm)
        clipped = [jnp.tanh(x) * 3 for x in clipped]
        clipped, n2 = jax.vmap(lambda t: jaxdet.clip_by_global_norm(t, 1e9))(clipped)
        return norms, clipped, n, n2

    leaves = [_rand((4, 3, 4096), F32, seed=14), _rand((4, 5000), BF16, seed=15), _rand((4,), F32, seed=16)]
    return fn, (leaves, np.asarray([0.5, 1e9, 2.0, 100.0], np.float32))


def _norms():
    def loss(x, scale, bias):
        y = jaxdet.rms_norm(x, scale)
        y = jaxdet.layer_norm(jnp.tanh(y), scale, bias)
        y = jaxdet.rms_norm(jnp.tanh(y), None)
        return _loss(y)

    n = 1024
    x = _rand((4, 33, n), BF16, seed=17)
    scale = 1 + _rand((n,), F32, seed=18, scale=0.1)
    return jax.value_and_grad(loss, argnums=(0, 1, 2)), (x, scale, _rand((n,), F32, seed=19, scale=0.1))


def _softmax(n, rows, seed):
    def loss(x):
        y = jaxdet.softmax(x)
        y = jaxdet.log_softmax(jnp.tanh(y) * 8)
        return _loss(jaxdet.softmax(y))

    return jax.value_and_grad(loss), (_rand((rows, n), BF16, seed=seed, scale=4),)


def _cross_entropy(n, rows, seed):
    def loss(x, labels):
        a = jaxdet.softmax_cross_entropy_with_integer_labels(x, labels)
        b = jaxdet.label_log_probs(jnp.tanh(x) * 8, labels)
        c = jaxdet.softmax_cross_entropy_with_integer_labels(x * 2, labels)
        return jnp.sum(a) + jnp.sum(b * b) + jnp.sum(c)

    labels = np.random.default_rng(seed).integers(0, n, rows).astype(np.int32)
    return jax.value_and_grad(loss), (_rand((rows, n), BF16, seed=seed, scale=4), labels)


def _attention():
    def loss(q, k, v):
        h = jnp.tanh(jaxdet.attention(q, k, v))
        return _loss(jaxdet.attention(h, k, v))

    q, k, v = _rand((1, 128, 4, 64), BF16, 20), _rand((1, 128, 2, 64), BF16, 21), _rand((1, 128, 2, 64), BF16, 22)
    return jax.value_and_grad(loss, argnums=(0, 1, 2)), (q, k, v)


def _det_math():
    # A test target of the shared exp / log / rsqrt, through its FFI target.
    def det_math(x, op):
        return jax.ffi.ffi_call("jaxdet_det_math", jax.ShapeDtypeStruct(x.shape, F32))(x, op=np.int32(op))

    def fn(x):
        outs = []
        for op in range(4):  # exp, log, rsqrt, exp_nonpositive
            y = det_math(jnp.abs(x) + 0.5 if op in (1, 2) else -jnp.abs(x) if op == 3 else x, op)
            outs.append(y)
            x = jnp.tanh(y)
        return outs

    return fn, (_rand((3000,), F32, seed=23),)


def _embed():
    # Two lookups (each one's table gradient is a jaxdet_segment_sum) and two segment sums, one of
    # them with a float32 result of bfloat16 data.
    def loss(table, x, ids):
        y = jnp.tanh(jaxdet.embed(table, ids))
        s = jaxdet.segment_sum(y * x, ids, table.shape[0])
        y = jnp.tanh(jaxdet.embed(table + s, ids[::-1]))
        return _loss(jaxdet.segment_sum(y, ids, 7, preferred_element_type=F32))

    ids = np.random.default_rng(29).integers(-2, 302, (2, 1000)).astype(np.int32)
    ids = np.where(ids < 0, 300, ids)  # out of range (not wrapped) in both functions
    table, x = _rand((300, 64), BF16, seed=30), _rand((2, 1000, 64), BF16, seed=31)
    return jax.value_and_grad(loss, argnums=(0, 1)), (table, x, ids)


def _reduce():
    # Rows (B == 1) and columns (B > 1) of one chunk, and several chunks (the partials, then the
    # tree's kernel), through jaxdet.sum and jaxdet.bias_add's gradient.
    def loss(x, b, long):
        y = jnp.tanh(jaxdet.bias_add(x, b))
        rows = jaxdet.sum(y, axis=1)
        cols = jaxdet.sum(y * y, axis=0, dtype=F32)
        return jnp.sum(rows.astype(F32)) + jnp.sum(cols) + jaxdet.sum(jnp.tanh(long), dtype=F32)

    x = _rand((64, 1000), BF16, seed=29)
    return jax.value_and_grad(loss, argnums=(0, 1, 2)), (x, _rand((1000,), BF16, seed=30), _rand((3, 20000), F32, 31))


SEGMENT = 8192  # elements per softmax segment (cuda/softmax/softmax_math.h kSegment)

CASES = {
    "philox": (("jaxdet_philox4x32_10",), _philox),
    "dropout": (("jaxdet_dropout",), _dropout),
    "matmul": (("jaxdet_gemm", "jaxdet_gemm_wgrad_init"), _matmul),
    "matmul_weight_grad": (("jaxdet_gemm_wgrad_init", "jaxdet_gemm_wgrad"), _matmul_weight_grad),
    "global_norm": (("jaxdet_global_norm",), _global_norm),
    "clip_by_global_norm": (("jaxdet_clip_global_norm",), _clip_by_global_norm),
    "clip_staged": (("jaxdet_clip_partials", "jaxdet_clip_finalize", "jaxdet_clip_apply"), _clip_staged),
    "norm": (("jaxdet_norm_fwd", "jaxdet_norm_bwd", "jaxdet_norm_param_grad"), _norms),
    # one segment per row (fused kernels) and three (thread block clusters on Hopper, else passes)
    "softmax": (("jaxdet_softmax_fwd", "jaxdet_softmax_bwd"), lambda: _softmax(1000, 64, 24)),
    "softmax_long_rows": (("jaxdet_softmax_fwd", "jaxdet_softmax_bwd"), lambda: _softmax(2 * SEGMENT + 3, 8, 25)),
    "cross_entropy": (("jaxdet_xent_fwd", "jaxdet_xent_bwd"), lambda: _cross_entropy(1000, 64, 26)),
    # few long rows: one cluster launch; more rows than a wave of clusters: the segment passes
    "cross_entropy_long_rows": (
        ("jaxdet_xent_fwd", "jaxdet_xent_bwd"),
        lambda: _cross_entropy(2 * SEGMENT + 3, 8, 27),
    ),
    "cross_entropy_many_long_rows": (
        ("jaxdet_xent_fwd", "jaxdet_xent_bwd"),
        lambda: _cross_entropy(2 * SEGMENT + 3, 2048, 28),
    ),
    "attention": (("jaxdet_attention_fwd", "jaxdet_attention_bwd"), _attention),
    "det_math": (("jaxdet_det_math",), _det_math),
    "embed": (("jaxdet_segment_sum",), _embed),
    "reduce": (("jaxdet_reduce",), _reduce),
}

GPU_TEST_TARGETS = frozenset(t for targets, _ in CASES.values() for t in targets)


def _build(case, device):
    targets, build = CASES[case]
    fn, args = build()
    return fn, jax.device_put(args, device), targets


# ---- The CUDA sources (CPU) ----


def _statement_end(text, open_paren):
    depth = 0
    for i in range(open_paren, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    raise AssertionError("unbalanced XLA_FFI_DEFINE_HANDLER_SYMBOL(...)")


def cuda_handlers():
    """{handler symbol: (source, compatible, reason)} for every XLA_FFI_DEFINE_HANDLER_SYMBOL of
    the CUDA sources: compatible when it declares kCmdBufferCompatible; reason: the text after
    `Not command-buffer compatible:` in the comment lines right above it (None without one)."""
    handlers = {}
    for path in CUDA_SOURCES:
        text = path.read_text()
        for m in re.finditer(r"\bXLA_FFI_DEFINE_HANDLER_SYMBOL\s*\(\s*(\w+)\s*,", text):
            body = text[m.start() : _statement_end(text, text.index("(", m.start())) + 1]
            comments = []
            for line in reversed(text[: m.start()].splitlines()):
                if not line.strip().startswith("//"):
                    break
                comments.insert(0, line.strip()[2:].strip())
            note = " ".join(comments)
            reason = note.split(NOT_COMPATIBLE, 1)[1].strip() if NOT_COMPATIBLE in note else None
            assert m.group(1) not in handlers, f"{m.group(1)} defined twice"
            handlers[m.group(1)] = (path.relative_to(ROOT).as_posix(), COMPATIBLE in body, reason)
    return handlers


def _strip_comments(text):
    return re.sub(r"/\*.*?\*/|//[^\n]*", " ", text.replace("\\\n", " "), flags=re.DOTALL)


def cuda_target_names(text=None):
    """{handler symbol: target name} as cuda/module.cc's cuda_targets() registers them: entries
    `d["name"] = EncapsulateFfiHandler(symbol);`, and X-macro lists `#define LIST(X) X(a, ...) ...`
    that the body expands with an adder `LIST(ADD)`,
    `#define ADD(p, ...) d["prefix" #p] = EncapsulateFfiHandler(pre##q##post);`."""
    text = _strip_comments(MODULE_CC.read_text() if text is None else text)
    start = text.index('m.def("cuda_targets"')
    body = text[start : text.index("});", start)]
    names = {sym: target for target, sym in re.findall(r'd\["(\w+)"\]\s*=\s*EncapsulateFfiHandler\((\w+)\)', body)}
    lists = {}
    for name, param, items in re.findall(r"#define\s+(\w+)\((\w+)\)([^\n]*)", text):
        found = [[a.strip() for a in args.split(",")] for args in re.findall(rf"\b{param}\(([^()]*)\)", items)]
        if found:
            lists[name] = found
    adders = {}
    for name, params, prefix, key, symbol in re.findall(
        r'#define\s+(\w+)\(([\w\s,]*)\)\s*d\["(\w*)"\s*#\s*(\w+)\]\s*=\s*EncapsulateFfiHandler\(([\w#\s]+)\);', text
    ):
        adders[name] = ([q.strip() for q in params.split(",")], prefix, key, [t.strip() for t in symbol.split("##")])
    for lst, add in re.findall(r"\b(\w+)\(\s*(\w+)\s*\)", body):
        if lst in lists and add in adders:
            params, prefix, key, pieces = adders[add]
            for args in lists[lst]:
                value = dict(zip(params, args, strict=True))
                names["".join(value.get(t, t) for t in pieces)] = prefix + value[key]
    assert names, "cuda/module.cc: no CUDA targets found (parser out of date?)"
    return names


def test_module_cc_parser_reads_both_registration_forms():
    one = """
#define ROWS(X) X(norm_fwd) X(det_math)
m.def("cuda_targets", []() {
    d["jaxdet_philox4x32_10"] = EncapsulateFfiHandler(jaxdet_philox_cuda);
#define ADD_CUDA(name) d["jaxdet_" #name] = EncapsulateFfiHandler(jaxdet_##name##_cuda);
    ROWS(ADD_CUDA)
  });"""
    two = """
#define TARGETS(X)                                                   \\
  X(philox4x32_10, philox) X(dropout, dropout)       /* dropout */ \\
      X(det_math, det_math)                          /* softmax */
m.def("cpu_targets", []() {
#define ADD_CPU(name, stem) d["jaxdet_" #name] = EncapsulateFfiHandler(jaxdet_##stem##_cpu);
    TARGETS(ADD_CPU)
  });
m.def("cuda_targets", []() {
#define ADD_CUDA(name, stem) d["jaxdet_" #name] = EncapsulateFfiHandler(jaxdet_##stem##_cuda);
    TARGETS(ADD_CUDA)
  });"""
    assert cuda_target_names(one) == {
        "jaxdet_philox_cuda": "jaxdet_philox4x32_10",
        "jaxdet_norm_fwd_cuda": "jaxdet_norm_fwd",
        "jaxdet_det_math_cuda": "jaxdet_det_math",
    }
    assert cuda_target_names(two) == {
        "jaxdet_philox_cuda": "jaxdet_philox4x32_10",
        "jaxdet_dropout_cuda": "jaxdet_dropout",
        "jaxdet_det_math_cuda": "jaxdet_det_math",
    }


def test_every_cuda_handler_declares_command_buffer_compatibility_or_a_reason():
    handlers = cuda_handlers()
    assert handlers, "no XLA_FFI_DEFINE_HANDLER_SYMBOL in cuda/*/*_cuda.cu"
    problems = []
    for sym, (source, compatible, reason) in sorted(handlers.items()):
        if compatible and reason is not None:
            problems.append(f"{source}: {sym} declares {COMPATIBLE} but carries `{NOT_COMPATIBLE}`")
        elif not compatible and not reason:
            problems.append(
                f"{source}: {sym} neither declares {{{COMPATIBLE}}} nor says why not "
                f"(`// {NOT_COMPATIBLE} <reason>` right above it)"
            )
    assert not problems, "\n".join(problems)


def test_every_compatible_cuda_target_is_run_in_command_buffers():
    handlers, names = cuda_handlers(), cuda_target_names()
    assert set(handlers) == set(names), (
        f"defined but not registered in cuda/module.cc: {sorted(set(handlers) - set(names))}; "
        f"registered but not defined in cuda/*/*_cuda.cu: {sorted(set(names) - set(handlers))}"
    )
    if _native.with_cuda:
        assert set(dict(_native.cuda_targets())) == set(names.values())
    compatible = {names[sym] for sym, (_, ok, _) in handlers.items() if ok}
    assert not compatible - GPU_TEST_TARGETS, f"compatible but not in CASES: {sorted(compatible - GPU_TEST_TARGETS)}"
    assert not GPU_TEST_TARGETS - compatible, f"in CASES but not compatible: {sorted(GPU_TEST_TARGETS - compatible)}"


@pytest.mark.parametrize("case", list(CASES))
def test_case_calls_its_targets(case):
    # The same primitives and FFI targets on every platform: compiled for the CPU, the case's
    # module calls every target the GPU test expects inside command buffers.
    fn, args, targets = _build(case, jax.devices("cpu")[0])
    called = command_buffers.custom_call_targets(jax.jit(fn).lower(*args).compile().as_text())
    assert set(targets) <= called, f"{case}: {sorted(set(targets) - called)} not called (calls {sorted(called)})"


# ---- GPU ----


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_compatible_handlers_run_in_command_buffers(case):
    # Command buffers of any length: the question is whether XLA accepts the handlers (a command
    # that XLA cannot record, between two custom calls, would otherwise leave short runs outside).
    fn, args, targets = _build(case, jax.devices("gpu")[0])
    command_buffers.check_in_command_buffers(fn, args, targets, min_graph_size=1)
