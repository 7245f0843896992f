"""Starts the rank processes of a multi-rank Python test and collects their results.

run(tmp_path, script, world, args_of, env_of): starts `python script OUT.json *args_of(rank)`
for every rank with OMP_NUM_THREADS=1, this interpreter's sys.path, torchrun's variables
removed and env_of(rank) added; waits (failing the test on a timeout, with every rank's
output and the Python stacks of the ranks still running, or on a rank's nonzero exit, with
its output) and returns every rank's OUT.json, parsed.
"""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def free_port():
    """A free port for a rendezvous store, below the kernel's ephemeral range: a port from
    that range (what binding port 0 gives) can be taken meanwhile as the source port of a
    client's connect, and a client retrying to connect to 127.0.0.1:port before the server
    listens can even connect to itself (seen on a fresh machine: rank 1's store client
    got 0 bytes and the ranks never met)."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(200):
        port = rng.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the whole range below is taken: any free one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank, world, port):
    """torchrun's variables for `rank` of `world` with the store on 127.0.0.1:port."""
    return dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _stop_all(procs):
    """Stops the ranks still running and returns every rank's output. A running rank gets
    SIGABRT first: faulthandler (PYTHONFAULTHANDLER) prints its threads' Python stacks, which
    say where it waited; then it is killed."""
    for q in procs:
        if q.poll() is None:
            q.send_signal(signal.SIGABRT)
    logs = []
    for rank, q in enumerate(procs):
        try:
            out = q.communicate(timeout=10)[0]
        except subprocess.TimeoutExpired:
            q.kill()
            out = q.communicate()[0]
        logs.append(f"--- rank {rank} (exit {q.returncode}) ---\n{out}")
    return "\n".join(logs)


def run(tmp_path, script, world, args_of=lambda rank: [], env_of=lambda rank: {}, timeout=300):
    procs, outs = [], []
    for rank in range(world):
        out = tmp_path / f"rank{rank}.json"
        outs.append(out)
        env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                   PYTHONFAULTHANDLER="1")
        env.update(env_of(rank))
        args = [sys.executable, str(script), str(out)] + [str(a) for a in args_of(rank)]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(0.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            pytest.fail(f"a rank timed out after {timeout} s; every rank's output, with the Python stacks of "
                        "those still running:\n" + _stop_all(procs))
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} failed:\n{logs[rank]}"
    return [json.loads(o.read_text()) for o in outs]
