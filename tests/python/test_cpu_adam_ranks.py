"""bench/cpu_adam_ranks.py runs (a smoke test of the program, not a measurement): two rank
processes step CPU-Adam together with each thread setting, results in its JSON, and
argument errors."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench" / "cpu_adam_ranks.py"


def run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def test_two_ranks_step_with_each_setting(tmp_path):
    out = tmp_path / "r.json"
    p = run(["--ranks", "2", "--params", "100000", "--steps", "2", "--rounds", "1", "--threads", "share,all,3",
             "--json", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(out.read_text())
    cores = len(os.sched_getaffinity(0))
    assert r["ranks"] == 2 and r["cores"] == cores
    threads = {x["setting"]: x["threads"] for x in r["results"]}
    assert threads == {"share": max(1, cores // 2), "all": cores, "3": 3}
    for x in r["results"]:
        assert x["step_s"] > 0 and x["gb_per_s"] > 0 and x["isa"] in ("scalar", "avx2", "avx512")
    assert "medians over 1 rounds" in p.stdout


def test_bad_arguments_are_refused(tmp_path):
    p = run(["--threads", "some"], tmp_path)
    assert p.returncode == 2 and "--threads 'some': expected share, all or a positive number" in p.stderr
    p = run(["--ranks", "0"], tmp_path)
    assert p.returncode == 2 and "must be at least 1" in p.stderr
