"""Whether jaxdet's custom calls run inside XLA's command buffers (CUDA graphs), and with the bits
they have outside: for the GPU tests of handlers marked command-buffer compatible
(tests/test_command_buffers.py, tests/test_gemm_buckets.py, tests/test_attention.py)."""

from __future__ import annotations

import glob
import os
import re
import tempfile

import jax

from jaxdet.testing import assert_bitwise_equal


def custom_call_targets(hlo_text) -> set[str]:
    """The custom-call targets an (optimized) HLO module calls."""
    return set(re.findall(r'custom_call_target="([^"]+)"', hlo_text))


def _command_buffer_bodies(hlo_text):
    """The bodies of the command-buffer computations of an optimized HLO module (XLA versions that
    form command buffers on HLO)."""
    return re.findall(r"\n(%?command_buffer[^\n]*\{\n.*?\n\})", hlo_text, flags=re.DOTALL)


def _custom_calls_in_command_buffers(dump_dir, hlo_text, targets):
    """(inside, outside): how many of the module's custom calls (only jaxdet's here) run inside a
    command buffer and how many outside. Newer XLA forms command buffers on the thunk sequence
    (the dump `*thunk_sequence_after_thunk_passes*.txt`: lines "<indent><index>: <kind> ...",
    thunks nested under a top-level kCommandBuffer indented); older XLA on HLO (computations named
    command_buffer)."""
    dumps = glob.glob(os.path.join(dump_dir, "*thunk_sequence_after_thunk_passes*.txt"))
    if not dumps:
        dumps = glob.glob(os.path.join(dump_dir, "*thunk_sequence.txt"))
    if dumps:
        inside = outside = 0
        in_cb = False
        with open(dumps[0]) as f:
            lines = f.read().splitlines()
        for line in lines:
            thunk = line.lstrip()
            head, sep, rest = thunk.partition(": ")
            if not sep or not head.isdigit():
                continue
            if thunk == line:  # top level
                in_cb = rest.startswith("kCommandBuffer")
            if rest.startswith("kCustomCall"):
                if in_cb:
                    inside += 1
                else:
                    outside += 1
        return inside, outside
    bodies = "\n".join(_command_buffer_bodies(hlo_text))
    total = sum(hlo_text.count(f'custom_call_target="{t}"') for t in targets)
    inside = sum(bodies.count(f'custom_call_target="{t}"') for t in targets)
    return inside, total - inside


def _compile_both(fn, args, dump_dir, min_graph_size=None):
    """fn compiled as XLA does by default (command buffers for sequences of >= 5 commands, or of
    >= `min_graph_size`; its dumps in `dump_dir`), and with command buffers out of reach (minimum
    graph size raised): the same HLO, fusions and kernels."""
    lowered = jax.jit(fn).lower(*args)
    options = {"xla_dump_to": dump_dir}
    if min_graph_size is not None:
        options["xla_gpu_graph_min_graph_size"] = min_graph_size
    return (
        lowered.compile(compiler_options=options),
        lowered.compile(compiler_options={"xla_gpu_graph_min_graph_size": 1 << 20}),
    )


def check_in_command_buffers(fn, args, targets, *, min_graph_size=None) -> int:
    """jit(fn) compiled twice: the module calls every custom-call target named in `targets`, and
    they all run inside command buffers (XLA puts a custom call there only when its handler is
    marked compatible) in the default compilation (or with command buffers of `min_graph_size`
    commands allowed: 1 asks only whether XLA accepts the handlers, whatever their neighbours);
    three calls in a row give the bits of the compilation without command buffers. The first of
    them records the graphs (a handler's one-time set-up in this process, if not done before,
    happens while XLA captures it), the others replay them. Returns how many custom calls run
    inside.

    The thunk dump does not name a custom call's target, so "every named target inside" is: each
    is called, no custom call runs outside, and at least as many run inside as the module has calls
    of the named targets."""
    with tempfile.TemporaryDirectory() as dump_dir:
        graphs, plain = _compile_both(fn, args, dump_dir, min_graph_size)
        hlo_text = graphs.as_text()
        inside, outside = _custom_calls_in_command_buffers(dump_dir, hlo_text, targets)
    called = custom_call_targets(hlo_text)
    missing = sorted(set(targets) - called)
    assert not missing, f"{targets}: the module does not call {missing} (it calls {sorted(called)})"
    named_calls = sum(hlo_text.count(f'custom_call_target="{t}"') for t in set(targets))
    assert inside >= named_calls > 0 and outside == 0, (
        f"{targets}: {inside} custom calls inside command buffers, {outside} outside ({named_calls} named calls)"
    )
    got = [jax.tree.leaves(graphs(*args)) for _ in range(3)]
    want = jax.tree.leaves(plain(*args))
    for run in got:
        assert len(run) == len(want)
        for g, w in zip(run, want):
            assert_bitwise_equal(g, w, "with command buffers vs without")
    return inside
