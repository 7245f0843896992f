"""Sizes left out of the config are sized from the model (core/sizing.h), through
bench/default_sizes.py on a small model (a run of the program, its memory asserted, not its
time): the same losses as DeepSpeed's sizes written out, with much less of the CPU device's
memory (DeepSpeed's bucket, capped at the model, is the whole model's gradients twice over)."""

import json
import pathlib
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_script  # noqa: E402


def test_left_out_sizes_are_sized_from_the_model(tmp_path):
    p = bench_script.run("default_sizes.py", ["--d", "512", "--layers", "8", "--steps", "2", "--rounds", "1"],
                         tmp_path, omp_threads=1)
    assert p.returncode == 0, p.stdout + p.stderr
    got = json.loads(p.stdout.strip().splitlines()[-1])
    sized, deepspeed = got["sized"], got["deepspeed"]
    assert sized["loss"] == deepspeed["loss"]
    model = 512 * 512 * 8 * 4
    # DeepSpeed's: two buckets of the whole model (2x the model; one rank reduces them in
    # place, no shard buffer beside them); sized: buckets of one block (a sixteenth of the
    # model, at least the largest group), so the device tier drops by about 1.75x the
    # model's bytes.
    assert deepspeed["device_tier"] - sized["device_tier"] >= 1.5 * model, got
    assert sized["host_tier"] < deepspeed["host_tier"], got
