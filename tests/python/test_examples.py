"""The README's Python quick start (examples/python/quickstart.py) runs and trains: one
process, and two ranks under torchrun (the torchrun of the interpreter that runs pytest)."""

import os
import pathlib
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

ROOT = pathlib.Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "python" / "quickstart.py"


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    pkg = str(pathlib.Path(strata.__file__).resolve().parents[1])  # the dir holding strata/
    env["PYTHONPATH"] = os.pathsep.join([pkg] + [p for p in [env.get("PYTHONPATH")] if p])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def test_quickstart_one_process():
    r = subprocess.run([sys.executable, str(QUICKSTART)], env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rank(s), 60 steps" in r.stdout and "60 optimizer steps" in r.stdout, r.stdout


def test_quickstart_two_ranks_under_torchrun():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), str(QUICKSTART)],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "2 rank(s), 60 steps" in out and "60 optimizer steps" in out, out
