"""Strata under tensor parallelism: strata.initialize(..., mpu=...) takes its
ranks from the mpu's data-parallel group. 2-way tensor x 2-way data parallel on 4 ranks,
the test's own column- and row-parallel layers (model_parallel_worker.py), matched against
the same model trained whole by torch.optim.AdamW."""

import os
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ranks  # noqa: E402

WORKER = HERE / "model_parallel_worker.py"


def run(tmp_path, mode, *extra):
    port = ranks.free_port()
    return ranks.run(tmp_path, WORKER, 4, lambda r: [r, port, mode, *extra])


def check_trained(results):
    for r in results:
        assert (r["engine_rank"], r["engine_world"], r["global_rank"]) == (r["dp"], 2, r["rank"]), r
        for got, want in zip(r["losses"], r["ref_losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["rank"], r["losses"], r["ref_losses"])
        assert len(r["param_rel_diff"]) == 10, r["param_rel_diff"]
        for name, d in r["param_rel_diff"].items():
            assert d <= 1e-5, (r["rank"], name, d)
    assert results[0]["ref_losses"][0] != results[0]["ref_losses"][-1], "the model did not train"


def test_tensor_times_data_parallel_matches_the_whole_model(tmp_path):
    check_trained(run(tmp_path, "train"))


def test_checkpoints_are_kept_per_model_parallel_rank(tmp_path):
    ckpt = tmp_path / "ckpt"
    results = run(tmp_path, "ckpt", ckpt)
    check_trained(results)  # resumed at step 3: the same as without the checkpoint
    assert sorted(os.listdir(ckpt)) == ["mp_rank_00", "mp_rank_01"]
    for d in ("mp_rank_00", "mp_rank_01"):
        assert (ckpt / d / "latest").read_text().strip() == "half"
        assert sorted(os.listdir(ckpt / d / "half")) == ["manifest.json", "rank-00000.bin", "rank-00001.bin"]


def test_gradient_clipping_with_model_parallelism_is_refused(tmp_path):
    for r in run(tmp_path, "clip"):
        assert r["error"] is not None and "gradient_clipping with model parallelism" in r["error"], r


def test_an_mpu_without_torch_distributed_is_a_clear_error():
    assert not torch.distributed.is_initialized()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
              "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(RuntimeError, match="mpu needs torch.distributed initialized"):
        strata.initialize(model=model, config=config, mpu=object())
