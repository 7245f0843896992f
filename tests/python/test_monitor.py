"""DeepSpeed's monitors (csv_monitor, tensorboard, wandb) in the Python engine
(strata/monitor.py): the events, their steps and values, writing every steps_per_print
steps off the step's thread, errors raised, the C++ front end's refusal is in
tests/engine."""

import csv
import importlib.util
import math
import pathlib

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

BATCH = 4
VOCAB = 32


class TokenModel(torch.nn.Module):
    """Token ids in, a scalar-able output: the monitor counts the tokens (model TFLOPS)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.l1 = torch.nn.Linear(16, 16)
        self.l2 = torch.nn.Linear(16, 1)

    def forward(self, input_ids):
        return self.l2(torch.tanh(self.l1(self.emb(input_ids)))).mean()


def read(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return rows[0], [(int(s), float(v)) for s, v in rows[1:]]


def train(engine, steps, gas=1, seed=1):
    """Returns each optimizer step's losses (the ones given to backward) and lr."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        losses = []
        for _ in range(gas):
            ids = torch.randint(0, VOCAB, (BATCH // gas, 8), generator=g)
            loss = engine(ids)
            engine.backward(loss)
            r = engine.step()
            losses.append(loss.item())
        assert r["boundary"]
        out.append((losses, r["lr"]))
    return out


def config(tmp_path, every, gas=1, **monitors):
    cfg = {"train_batch_size": BATCH, "gradient_accumulation_steps": gas, "steps_per_print": every,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01,
                                                       "warmup_num_steps": 2, "warmup_type": "linear"}}}
    cfg.update(monitors)
    return cfg


def test_csv_monitor_writes_deepspeeds_and_stratas_events(tmp_path):
    """Two optimizer steps of two micro-steps, steps_per_print 1: DeepSpeed's events at every
    step (x = samples), with the values the run had; Strata's interval events (phases, waits,
    throughput, memory) from the second write on."""
    cfg = config(tmp_path, 1, gas=2, csv_monitor={"enabled": True, "output_path": str(tmp_path),
                                                  "job_name": "job"})
    engine, *_ = strata.initialize(model=TokenModel(), config=cfg)
    try:
        steps = train(engine, 2, gas=2)
    finally:
        engine.close()
    d = tmp_path / "job"
    header, rows = read(d / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == [BATCH, 2 * BATCH]
    for (_, v), (losses, _) in zip(rows, steps):
        assert math.isclose(v, sum(losses) / len(losses), rel_tol=1e-6), (v, losses)
    header, rows = read(d / "Train_Samples_lr.csv")
    assert header == ["step", "lr"]
    assert [v for _, v in rows] == pytest.approx([lr for _, lr in steps], rel=1e-12)
    assert not (d / "Train_Samples_loss_scale.csv").exists()  # fp16 only, as DeepSpeed
    # Interval events: the first write starts the interval, the second has its means.
    for name in ("Train_Samples_elapsed_time_ms_forward", "Train_Samples_elapsed_time_ms_backward",
                 "Train_Samples_elapsed_time_ms_step", "Train_Samples_samples_per_sec",
                 "Strata_wait_ms_all_gather", "Strata_wait_ms_reduce", "Strata_wait_ms_optimizer",
                 "Strata_wait_ms_working_shard", "Strata_model_tflops"):
        header, rows = read(d / f"{name}.csv")
        assert header[0] == "step", header
        assert [s for s, _ in rows] == [2 * BATCH], (name, rows)
        assert rows[0][1] >= 0, (name, rows)
    for name in ("Train_Samples_elapsed_time_ms_forward", "Train_Samples_samples_per_sec", "Strata_model_tflops"):
        assert read(d / f"{name}.csv")[1][0][1] > 0, name
    # Memory at every write: the process's resident set, the tiers.
    _, rows = read(d / "Strata_host_rss_gib.csv")
    assert [s for s, _ in rows] == [BATCH, 2 * BATCH] and all(v > 0.01 for _, v in rows), rows
    _, rows = read(d / "Strata_device_tier_peak_gib.csv")
    assert all(v > 0 for _, v in rows), rows


def test_csv_monitor_writes_every_steps_per_print_and_the_rest_at_close(tmp_path):
    """steps_per_print 2, three steps: after step 2 the file has two rows, step 3's row is
    written by close(); a second run appends under the same header."""
    cfg = config(tmp_path, 2, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    path = tmp_path / "j" / "Train_Samples_lr.csv"
    engine, *_ = strata.initialize(model=TokenModel(), config=cfg)
    try:
        train(engine, 1)
        engine._monitor.queue.join()  # the writer is idle: what is on disk is all there is
        assert not path.exists()
        train(engine, 1)
        engine._monitor.queue.join()
        assert [s for s, _ in read(path)[1]] == [BATCH, 2 * BATCH]
        train(engine, 1)
        engine._monitor.queue.join()
        assert len(read(path)[1]) == 2
    finally:
        engine.close()
    assert [s for s, _ in read(path)[1]] == [BATCH, 2 * BATCH, 3 * BATCH]
    engine, *_ = strata.initialize(model=TokenModel(), config=cfg)
    try:
        train(engine, 2)
    finally:
        engine.close()
    header, rows = read(path)
    assert header == ["step", "lr"] and len(rows) == 5


def test_a_write_that_fails_is_raised_by_the_next_step(tmp_path):
    """The job directory replaced by a file: the writer thread fails, the next step raises
    it naming the monitor; the engine still closes."""
    cfg = config(tmp_path, 1, csv_monitor={"enabled": True, "output_path": str(tmp_path), "job_name": "j"})
    engine, *_ = strata.initialize(model=TokenModel(), config=cfg)
    try:
        (tmp_path / "j").rmdir()
        (tmp_path / "j").write_text("not a directory")
        train(engine, 1)
        engine._monitor.queue.join()
        with pytest.raises(RuntimeError, match="a monitor could not write its events: NotADirectoryError"):
            train(engine, 1)
    finally:
        engine.close()


def test_csv_monitor_output_path_that_cannot_be_made_is_refused_at_initialize(tmp_path):
    (tmp_path / "file").write_text("x")
    cfg = config(tmp_path, 1, csv_monitor={"enabled": True, "output_path": str(tmp_path / "file")})
    with pytest.raises(OSError, match="csv_monitor.output_path"):
        strata.initialize(model=TokenModel(), config=cfg)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="the tensorboard package is not installed (requirements.txt pins it)")
def test_tensorboard_monitor_writes_the_same_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = config(tmp_path, 1, tensorboard={"enabled": True, "output_path": str(tmp_path), "job_name": "tb"})
    engine, *_ = strata.initialize(model=TokenModel(), config=cfg)
    try:
        steps = train(engine, 2)
    finally:
        engine.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/elapsed_time_ms_backward",
            "Strata/model_tflops", "Strata/host_rss_gib"} <= tags, tags
    loss = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss] == [BATCH, 2 * BATCH]
    assert [e.value for e in loss] == pytest.approx([l[0] for l, _ in steps], rel=1e-6)


def test_a_monitor_whose_package_is_missing_is_refused_with_the_package_named(tmp_path, monkeypatch):
    import strata.monitor as monitor

    real = importlib.util.find_spec
    monkeypatch.setattr(monitor.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "tensorboard") else real(name, *a))
    for key in ("wandb", "tensorboard"):
        cfg = config(tmp_path, 1, **{key: {"enabled": True}})
        with pytest.raises(ImportError, match=f"{key}.enabled needs the {key} package.*pip install {key}"):
            strata.initialize(model=TokenModel(), config=cfg)


def test_monitor_keys_are_validated():
    with pytest.raises(strata.ConfigError, match="csv_monitor.output_path"):
        strata.validate_config({"train_batch_size": 1, "csv_monitor": {"enabled": True, "output_path": 3}})
    with pytest.raises(strata.ConfigError, match="csv_monitor.job"):
        strata.validate_config({"train_batch_size": 1, "csv_monitor": {"job": "x"}})
    full = strata.validate_config({"train_batch_size": 1, "csv_monitor": {"enabled": True}})
    assert full["csv_monitor"] == {"enabled": True, "output_path": "", "job_name": "DeepSpeedJobName"}


def test_no_monitor_no_thread(tmp_path):
    engine, *_ = strata.initialize(model=TokenModel(), config=config(tmp_path, 1))
    try:
        assert engine._monitor.thread is None and not engine._monitor.active
        train(engine, 1)
    finally:
        engine.close()


def test_on_two_ranks_only_rank_0_writes_its_own_losses(tmp_path):
    """Two gloo ranks: rank 0 writes the events (its loss, the lr), rank 1 writes nothing
    (not even the directory), and the samples count the global batch."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import ranks

    port = ranks.free_port()
    results = ranks.run(tmp_path, pathlib.Path(__file__).resolve().parent / "monitor_worker.py", 2,
                        args_of=lambda rank: [tmp_path], env_of=lambda rank: ranks.torchrun_env(rank, 2, port))
    assert [r["world"] for r in results] == [2, 2]
    assert not (tmp_path / "rank1").exists()
    _, rows = read(tmp_path / "rank0" / "j" / "Train_Samples_train_loss.csv")
    assert [s for s, _ in rows] == [BATCH, 2 * BATCH, 3 * BATCH]
    assert [v for _, v in rows] == pytest.approx([l for l, _ in results[0]["steps"]], rel=1e-6)
    _, rows = read(tmp_path / "rank0" / "j" / "Train_Samples_lr.csv")
    assert [v for _, v in rows] == pytest.approx([lr for _, lr in results[0]["steps"]], rel=1e-12)
