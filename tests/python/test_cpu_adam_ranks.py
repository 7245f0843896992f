"""bench/cpu_adam_ranks.py runs (a smoke test of the program, not a measurement): two rank
processes step CPU-Adam together with each thread setting, results in its JSON, and
argument errors."""

import json
import os
import pathlib
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_script  # noqa: E402


def run(args, tmp_path):
    return bench_script.run("cpu_adam_ranks.py", args, tmp_path, omp_threads=1)


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
