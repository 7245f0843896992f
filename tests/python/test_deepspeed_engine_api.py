"""DeepSpeed engine's counters and switches that user scripts read (issue 77's "Missing API"),
on one rank with the toy model: their values through accumulation, an fp16 overflow and a
checkpoint, and the answer for an attribute neither the engine nor the model has. Before
this module none of these attributes existed: each lookup fell through to the model and
raised "'Net' object has no attribute ..."."""

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402
import toy_model  # noqa: E402
from log_lines import LogLines  # noqa: E402


def config(**extra):
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.95]}},
        "zero_optimization": {"stage": 3},
    }
    cfg.update(extra)
    return cfg


def train(engine, steps, seed=1):
    out = None
    for x, y in toy_model.batches(steps, 4, seed=seed):
        loss = toy_model.loss_fn(engine(x), y)
        engine.backward(loss)
        out = engine.step()
    return out


def test_counters_follow_accumulation_and_checkpoints(tmp_path):
    engine, *_ = strata.initialize(model=toy_model.make_model(), config=config())
    try:
        assert (engine.global_steps, engine.global_samples, engine.skipped_steps) == (0, 0, 0)
        assert engine.train_batch_size() == 8
        assert engine.train_micro_batch_size_per_gpu() == 4
        assert engine.gradient_accumulation_steps() == 2
        assert engine.zero_optimization_stage() == 3
        assert (engine.bfloat16_enabled(), engine.fp16_enabled()) == (False, False)
        assert engine.get_global_grad_norm() is None and not engine.was_step_applied()
        assert engine.get_mom() == [(0.8, 0.95)]
        train(engine, 1)  # a micro-step: no boundary
        assert engine.global_steps == 0 and not engine.was_step_applied()
        out = train(engine, 1, seed=2)
        assert (engine.global_steps, engine.global_samples) == (1, 8)
        assert engine.was_step_applied()
        assert engine.get_global_grad_norm() == out["global_norm"] > 0
        train(engine, 4)
        assert (engine.global_steps, engine.global_samples) == (3, 24)
        engine.save_checkpoint(tmp_path)
    finally:
        engine.close()
    again, *_ = strata.initialize(model=toy_model.make_model(), config=config())
    try:
        again.load_checkpoint(tmp_path)
        assert (again.global_steps, again.global_samples) == (3, 24)
        assert again.local_rank == int(os.environ.get("LOCAL_RANK", "0"))
    finally:
        again.destroy()
    with pytest.raises(RuntimeError):
        again.step()  # destroyed: closed as close() does


def test_an_fp16_overflow_is_a_skipped_step_not_an_applied_one():
    engine, *_ = strata.initialize(model=toy_model.make_model(),
                                   config=config(train_batch_size=4, fp16={"enabled": True, "initial_scale_power": 8}))
    try:
        assert engine.fp16_enabled() and not engine.bfloat16_enabled()
        x, y = next(toy_model.batches(1, 4))
        loss = toy_model.loss_fn(engine(x), y) * float("inf")
        engine.backward(loss)
        engine.step()
        assert engine.global_steps == 1 and engine.skipped_steps == 1
        assert not engine.was_step_applied()
        train(engine, 1)
        assert engine.was_step_applied() and engine.skipped_steps == 1
    finally:
        engine.close()


def test_an_attribute_nobody_has_names_the_engine():
    model = toy_model.make_model()
    engine, *_ = strata.initialize(model=model, config=config())
    try:
        assert engine.head is model.head  # the model's own still fall through
        with pytest.raises(AttributeError, match=r"neither the engine nor its model \(Net\) has an attribute 'no_such'"):
            engine.no_such
        with pytest.raises(AttributeError, match="the engine has no no_sync .DeepSpeed's engine has.: with ZeRO"):
            engine.no_sync()
        with pytest.raises(AttributeError, match="the engine has no set_gradient_accumulation_boundary"):
            engine.set_gradient_accumulation_boundary(True)
        live = engine.statistics()["coordinator"]["live_elements"]
        engine.empty_partition_cache()  # DeepSpeed's tests call it before a save: nothing held
        assert engine.statistics()["coordinator"]["live_elements"] == live
    finally:
        engine.close()


def test_a_save_inside_an_accumulation_says_so(tmp_path):
    """DeepSpeed saves after a step() that was not a boundary and drops the micro-steps
    accumulated so far; Strata refuses, saying why and when to save (before: the wrong reason,
    "between a backward and its step")."""
    engine, *_ = strata.initialize(model=toy_model.make_model(), config=config())
    try:
        train(engine, 1)
        with pytest.raises(RuntimeError, match=r"in the middle of a gradient accumulation \(micro-step 1 of 2 "
                                               r"done\).*one in every 2 step\(\) calls"):
            engine.save_checkpoint(tmp_path)
        train(engine, 1, seed=2)
        assert engine.save_checkpoint(tmp_path).endswith("global_step1")
    finally:
        engine.close()


def test_wall_clock_breakdown_logs_each_phase_with_the_progress_line():
    """DeepSpeed's wall_clock_breakdown: the mean forward, backward and step time per
    micro-step since the last line (before: the key was refused)."""
    engine, *_ = strata.initialize(model=toy_model.make_model(),
                                   config=config(wall_clock_breakdown=True, steps_per_print=2))
    try:
        with LogLines() as log:
            train(engine, 8)
        lines = [line for line in log.lines if "time (ms)" in line]
        assert len(lines) == 2, log.lines  # 4 optimizer steps, a line every 2
        for line in lines:
            values = [float(v) for v in re.findall(r"_microstep: ([0-9.]+)", line)]
            assert len(values) == 3 and all(v > 0 for v in values), line
    finally:
        engine.close()
    quiet, *_ = strata.initialize(model=toy_model.make_model(), config=config(steps_per_print=1))
    with LogLines() as log:
        train(quiet, 2)
    assert log.lines and not [line for line in log.lines if "time (ms)" in line]
    quiet.close()
