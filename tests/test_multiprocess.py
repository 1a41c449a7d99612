"""jaxdet.parallel across processes: JAX's own multi-controller runtime (jax.distributed.initialize,
a localhost coordinator) gives the bits of the single-process run: 2 processes x 4 CPU devices
(gloo CPU collectives) those of 8 devices in one process, and on a machine with 2 GPUs, 2 processes
x 1 GPU (NCCL between them) those of one GPU (docs/parallel.md, "Several processes and nodes")."""

import json
import os
import socket
import subprocess
import sys

import jax
import pytest

from jaxdet._src.parallel.contracts import subprocess_env

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_worker.py")
STEPS = 20


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _last_json(text):
    # gloo logs its connections to stdout; the worker's result is the last line
    return json.loads(text.strip().splitlines()[-1])


def _run_processes(count, steps, env_of):
    """Starts `count` worker processes of one multi-controller run (env_of(i): process i's
    environment) and returns their results."""
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "multi", str(i), str(count), str(port), str(steps)],
            env=env_of(i),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            assert p.returncode == 0, f"process failed:\n{err[-4000:]}"
            outs.append(_last_json(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def _run_single(mode, *args, env):
    proc = subprocess.run(
        [sys.executable, WORKER, mode, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return _last_json(proc.stdout)


def test_two_processes_equal_one_process_of_eight_devices():
    outs = _run_processes(2, STEPS, lambda i: subprocess_env(4))
    want = _run_single("train", STEPS, 8, env=subprocess_env(8))["tree8"]["hashes"]
    assert len(want) == STEPS
    for r in outs:
        assert (r["devices"], r["local_devices"]) == (8, 4)
        assert r["same_on_devices"], f"process {r['process']}: its devices differ"
        assert r["hashes"] == want, f"process {r['process']} differs from the single-process D=8 run"


@pytest.mark.gpu
def test_two_gpu_processes_equal_one_gpu():
    """2 processes x 1 GPU (NCCL between processes, as across nodes) give the single-GPU bits."""
    if len(jax.devices("gpu")) < 2:
        pytest.skip("needs 2 GPUs")

    def gpu_env(visible):
        env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
        env.update(NCCL_NVLS_ENABLE="0", CUDA_VISIBLE_DEVICES=visible)
        return env

    steps = 5
    outs = _run_processes(2, steps, lambda i: gpu_env(str(i)))
    want = _run_single("gpu", steps, env=gpu_env("0,1"))["tree1"]["hashes"]
    for r in outs:
        assert (r["devices"], r["local_devices"]) == (2, 1)
        assert r["hashes"] == want, f"process {r['process']} differs from the single-GPU run"
