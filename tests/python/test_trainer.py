"""StrataTrainer: transformers.Trainer training through a Strata engine. A small
random Llama trains with the plain Trainer's losses (adamw_torch, the same data, seed,
linear schedule with warm-up, gradient accumulation and clipping; fp32, no dropout) within
1e-5 over 20 steps, on one rank and on 2 gloo ranks under torchrun; with gradient
checkpointing from TrainingArguments; save_steps checkpoints resume with the uninterrupted
run's losses; save_model writes what from_pretrained loads; "auto" values are filled as
Hugging Face's DeepSpeed integration fills them and a disagreeing value is refused.
Nothing downloaded."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from strata.integrations.transformers import StrataTrainer, fill_auto_values  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import hf_model  # noqa: E402
import trainer_common as tc  # noqa: E402


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def reference(tmp_path, logs=None, **overrides):
    """The plain Trainer's per-step losses and final model (its per-step logs into
    ``logs``, a list, when given)."""
    model = hf_model.make_model(0)
    trainer = tc.recording(transformers.Trainer)(
        model=model, args=tc.arguments(tmp_path / "ref", **overrides), train_dataset=tc.Rows()
    )
    trainer.train()
    if logs is not None:
        logs.extend(h for h in trainer.state.log_history if "loss" in h)
    return tc.step_losses(trainer.micro_losses), model


def strata_run(out, strata_config=None, resume=None, **overrides):
    trainer = tc.recording(StrataTrainer)(
        model=hf_model.make_model(0), args=tc.arguments(out, **overrides), train_dataset=tc.Rows(),
        strata_config=strata_config,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def assert_same_losses(got, want):
    assert len(got) == len(want) == tc.STEPS, (len(got), len(want))
    for step, (a, b) in enumerate(zip(got, want)):
        assert rel(a, b) <= 1e-5, (step, a, b)


def test_strata_trainer_trains_with_the_trainers_losses_checkpoints_resumes_and_saves(tmp_path):
    ref_logs = []
    want, ref_model = reference(tmp_path, ref_logs)
    # The config's values left to the Trainer ("auto"), as a config written for the
    # Trainer's DeepSpeed integration has them.
    cfg = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    }
    out = tmp_path / "run"
    trainer = strata_run(out, cfg, save_strategy="steps", save_steps=10)
    assert_same_losses(tc.step_losses(trainer.micro_losses), want)
    # The final parameters as the plain Trainer's.
    params = trainer.engine.gather_parameters()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-5, msg=name)
    # The Trainer's logs at every step: the learning rate of the step (the linear schedule
    # with warm-up, as the plain Trainer's) and the engine's gradient norm before clipping
    # (as the plain Trainer's, and above max_grad_norm: clipping was at work).
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == len(ref_logs) == tc.STEPS
    assert [h["learning_rate"] for h in logs] == [h["learning_rate"] for h in ref_logs]
    for h, r in zip(logs, ref_logs):
        assert rel(h["grad_norm"], r["grad_norm"]) <= 1e-4, (h, r)
    assert max(h["grad_norm"] for h in logs) > 0.5
    # checkpoint-10 and checkpoint-20: the model in Hugging Face's layout, a Strata
    # checkpoint and the Trainer's state.
    for n in (10, 20):
        folder = out / f"checkpoint-{n}"
        names = {p.name for p in folder.iterdir()}
        assert {"model.safetensors", "config.json", "latest", f"global_step{n}", "trainer_state.json"} <= names, names

    # Resumed from checkpoint-10: steps 11..20 as the uninterrupted run's.
    resumed = strata_run(out, cfg, resume=str(out / "checkpoint-10"), save_strategy="no")
    got = tc.step_losses(resumed.micro_losses)
    assert len(got) == tc.STEPS - 10
    for step, (a, b) in enumerate(zip(got, tc.step_losses(trainer.micro_losses)[10:])):
        assert rel(a, b) <= 1e-6, (step + 10, a, b)

    # save_model: what AutoModelForCausalLM.from_pretrained loads, with the trained logits.
    trainer.save_model(str(tmp_path / "final"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    ids = tc.Rows(seed=9).ids[:2]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, trainer.engine(input_ids=ids).logits)
        torch.testing.assert_close(ref_model(input_ids=ids).logits, loaded(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    trainer.engine.close()
    resumed.engine.close()


def test_strata_trainer_with_gradient_checkpointing_from_training_arguments(tmp_path):
    want, _ = reference(tmp_path)
    trainer = strata_run(tmp_path / "gc", gradient_checkpointing=True)
    assert trainer.model.is_gradient_checkpointing
    assert_same_losses(tc.step_losses(trainer.micro_losses), want)
    trainer.engine.close()


def test_strata_trainer_on_two_gloo_ranks_under_torchrun(tmp_path):
    want, _ = reference(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), str(HERE / "trainer_worker.py"), str(tmp_path / "w")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    got = json.loads([l for l in r.stdout.splitlines() if l.startswith("LOSSES ")][0][len("LOSSES "):])
    assert_same_losses(got, want)


def test_strata_trainer_on_a_peft_model(tmp_path):
    """A PEFT LoRA model through StrataTrainer (gradient checkpointing, evaluation, a
    checkpoint): the plain Trainer's losses; evaluate() is the engine's evaluation; the
    checkpoint and save_model hold the adapters as PEFT writes them."""
    peft = pytest.importorskip("peft")

    def lora():
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        torch.manual_seed(1)
        return peft.get_peft_model(hf_model.make_model(0), config)

    # With the progress bar on (tqdm; the other tests turn it off).
    overrides = dict(max_steps=6, gradient_checkpointing=True, learning_rate=1e-2, disable_tqdm=False)
    ref = tc.recording(transformers.Trainer)(model=lora(), args=tc.arguments(tmp_path / "ref", **overrides),
                                             train_dataset=tc.Rows())
    ref.train()
    evaluation = torch.utils.data.Subset(tc.Rows(seed=5), range(4))
    trainer = tc.recording(StrataTrainer)(
        model=lora(),
        args=tc.arguments(tmp_path / "run", save_strategy="steps", save_steps=3, per_device_eval_batch_size=2, **overrides),
        train_dataset=tc.Rows(), eval_dataset=evaluation,
    )
    trainer.train()
    got, want = tc.step_losses(trainer.micro_losses), tc.step_losses(ref.micro_losses)
    assert len(got) == len(want) == 6
    for step, (a, b) in enumerate(zip(got, want)):
        assert rel(a, b) <= 1e-5, (step, a, b)
    ids = tc.Rows(seed=5).ids[:4]
    with torch.no_grad():
        direct = trainer.engine(input_ids=ids, labels=ids).loss.item()
    assert trainer.evaluate()["eval_loss"] == pytest.approx(direct, rel=1e-6)
    assert {"adapter_model.safetensors", "adapter_config.json", "global_step3", "latest"} <= {
        p.name for p in (tmp_path / "run" / "checkpoint-3").iterdir()
    }
    trainer.save_model(str(tmp_path / "final"))
    loaded = peft.PeftModel.from_pretrained(hf_model.make_model(0), tmp_path / "final")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, labels=ids).loss.item(), direct, rtol=1e-5, atol=1e-6)
    trainer.engine.close()


def test_fill_auto_values_as_the_deepspeed_integration():
    args = tc.arguments("unused", per_device_train_batch_size=4, gradient_accumulation_steps=3, warmup_steps=0.1,
                        bf16=True)
    model = hf_model.make_model(0)
    cfg = {
        "train_batch_size": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
    }
    got = fill_auto_values(cfg, args, 100, model)
    assert got["train_batch_size"] == 12 and got["train_micro_batch_size_per_gpu"] == 4
    assert got["gradient_accumulation_steps"] == 3 and got["gradient_clipping"] == 0.5
    assert got["optimizer"]["params"] == {"lr": 2e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert got["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 2e-3, "warmup_num_steps": 10,
                                          "total_num_steps": 100}
    assert got["zero_optimization"]["reduce_bucket_size"] == hf_model.HIDDEN**2
    assert got["zero_optimization"]["stage3_param_persistence_threshold"] == 10 * hf_model.HIDDEN
    assert got["bf16"] == {"enabled": True}
    assert cfg["train_batch_size"] == "auto"  # the given config is not changed
    # A given value that disagrees with TrainingArguments is refused, every one named.
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=8 vs TrainingArguments per_device_train_batch_size=4(.|\n)*optimizer.params.lr=0.1"):
        fill_auto_values({"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}},
                         args, 100, model)
    # "auto" outside the table stays for the config parser, which refuses it by name.
    with pytest.raises(ValueError, match="auto"):
        strata.initialize(model=model, config=fill_auto_values({"strata": {"device_budget": "auto"}}, args, 100, model))
    with pytest.raises(ValueError, match="optim='sgd'|Strata's optimizer"):
        fill_auto_values({}, tc.arguments("unused", optim="sgd"), 100, model)


def test_strata_trainer_refuses_what_it_cannot_do(tmp_path):
    model = hf_model.make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="optimizers=\\(...\\) is not supported"):
        StrataTrainer(model=model, args=tc.arguments(tmp_path), train_dataset=tc.Rows(), optimizers=(opt, None))
    # An epoch that ends with a shorter accumulation than the engine's.
    trainer = StrataTrainer(model=model, args=tc.arguments(tmp_path, gradient_accumulation_steps=3, max_steps=30),
                            train_dataset=tc.Rows())
    with pytest.raises(ValueError, match="not a multiple of gradient_accumulation_steps=3"):
        trainer.train()
    with pytest.raises(FileNotFoundError, match="holds no Strata checkpoint"):
        StrataTrainer(model=hf_model.make_model(0), args=tc.arguments(tmp_path), train_dataset=tc.Rows()).train(
            resume_from_checkpoint=str(tmp_path)
        )


def test_load_best_model_at_end_loads_the_best_checkpoints_values(tmp_path):
    """load_best_model_at_end (EarlyStoppingCallback needs it): at the end of training the
    engine holds the values of the checkpoint-N with the best eval loss (before: refused
    when the Trainer was made)."""
    from strata.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    trainer = StrataTrainer(
        model=hf_model.make_model(0), train_dataset=tc.Rows(), eval_dataset=tc.Rows(seed=11),
        args=tc.arguments(tmp_path / "run", eval_strategy="steps", eval_steps=5, save_strategy="steps",
                          save_steps=5, load_best_model_at_end=True, metric_for_best_model="loss",
                          greater_is_better=False, learning_rate=5e-2, warmup_steps=0),
        callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=1)],
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    assert best is not None and best.endswith(f"checkpoint-{min(evals, key=evals.get)}"), (best, evals)
    want = get_fp32_state_dict_from_zero_checkpoint(best)
    got = trainer.engine.gather_parameters()
    assert all(torch.equal(got[n], want[n]) for n in want)
    if min(evals, key=evals.get) != max(evals):  # the last is not the best: something was loaded
        last = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "run" / f"checkpoint-{max(evals)}")
        assert not all(torch.equal(got[n], last[n]) for n in last)
