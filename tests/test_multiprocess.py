"""jaxdet.parallel across processes: JAX's own multi-controller runtime (jax.distributed.initialize,
a localhost coordinator, gloo CPU collectives), 2 processes x 4 CPU devices, gives the bits of the
single-process run on 8 devices (docs/parallel.md, "Several processes and nodes")."""

import json
import os
import socket
import subprocess
import sys

from jaxdet.contracts.parallel import subprocess_env

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "parallel_worker.py")
STEPS = 20


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _last_json(text):
    # gloo logs its connections to stdout; the worker's result is the last line
    return json.loads(text.strip().splitlines()[-1])


def test_two_processes_equal_one_process_of_eight_devices():
    port = _free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, "multi", str(i), "2", str(port), str(STEPS)],
            env=subprocess_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
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
    single = subprocess.run(
        [sys.executable, WORKER, "train", str(STEPS), "8"],
        env=subprocess_env(8),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert single.returncode == 0, single.stderr[-4000:]
    want = _last_json(single.stdout)["tree8"]["hashes"]
    assert len(want) == STEPS
    for r in outs:
        assert (r["devices"], r["local_devices"]) == (8, 4)
        assert r["same_on_devices"], f"process {r['process']}: its devices differ"
        assert r["hashes"] == want, f"process {r['process']} differs from the single-process D=8 run"
