"""Starts the rank processes of a multi-rank Python test and collects their results.

run(tmp_path, script, world, args_of, env_of): starts `python script OUT.json *args_of(rank)`
for every rank with OMP_NUM_THREADS=1, this interpreter's sys.path, torchrun's variables
removed and env_of(rank) added; waits (failing the test on a timeout or a rank's nonzero
exit, with its output) and returns every rank's OUT.json, parsed.
"""

import json
import os
import socket
import subprocess
import sys

import pytest

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank, world, port):
    """torchrun's variables for `rank` of `world` with the store on 127.0.0.1:port."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run(tmp_path, script, world, args_of=lambda rank: [], env_of=lambda rank: {}, timeout=300):
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.json"
        outs.append(out)
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.update(env_of(rank))
        args = [sys.executable, str(script), str(out)] + [str(a) for a in args_of(rank)]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank timed out:\n" + "\n".join(logs))
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{logs[rank]}"
    return [json.loads(o.read_text()) for o in outs]
