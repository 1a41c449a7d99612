"""Whether jaxdet's custom calls run inside XLA's command buffers (CUDA graphs), and with the bits
they have outside: for the GPU tests of handlers marked command-buffer compatible
(tests/test_gemm_buckets.py, tests/test_attention.py)."""

from __future__ import annotations

import glob
import os
import re
import tempfile

import jax

from jaxdet.testing import assert_bitwise_equal


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


def _compile_both(fn, args, dump_dir):
    """fn compiled as XLA does by default (command buffers for sequences of >= 5 commands; its
    dumps in `dump_dir`), and with command buffers out of reach (minimum graph size raised): the
    same HLO, fusions and kernels."""
    lowered = jax.jit(fn).lower(*args)
    return (
        lowered.compile(compiler_options={"xla_dump_to": dump_dir}),
        lowered.compile(compiler_options={"xla_gpu_graph_min_graph_size": 1 << 20}),
    )


def check_in_command_buffers(fn, args, targets) -> int:
    """jit(fn) compiled twice: the custom calls named in `targets` all run inside command buffers
    (XLA puts a custom call there only when its handler is marked compatible) in the default
    compilation, and three calls in a row (recorded, then replayed) give the bits of the
    compilation without command buffers. Returns how many run inside."""
    with tempfile.TemporaryDirectory() as dump_dir:
        graphs, plain = _compile_both(fn, args, dump_dir)
        inside, outside = _custom_calls_in_command_buffers(dump_dir, graphs.as_text(), targets)
    assert inside > 0 and outside == 0, f"{targets}: {inside} custom calls inside command buffers, {outside} outside"
    want = jax.tree.leaves(plain(*args))
    for _ in range(3):
        for g, w in zip(jax.tree.leaves(graphs(*args)), want):
            assert_bitwise_equal(g, w, "with command buffers vs without")
    return inside
