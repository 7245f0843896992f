"""The README's Python quick start (examples/python/quickstart.py) and the Hugging Face
examples (examples/python/huggingface.py: from_pretrained under strata.zero.Init, a change
under GatheredParameters, save_pretrained, the saved model's logits; hf_trainer.py:
StrataTrainer with a checkpoint, a resume and save_model; peft_lora.py: a PEFT LoRA model
without blocks=, its adapters saved for PeftModel.from_pretrained) run and train: one
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


HUGGINGFACE = ROOT / "examples" / "python" / "huggingface.py"


def test_huggingface_example_one_process(tmp_path):
    pytest.importorskip("transformers")
    r = subprocess.run([sys.executable, str(HUGGINGFACE), "--out", str(tmp_path / "tuned")], env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rank(s), 30 steps" in r.stdout and "from_pretrained gives the engine's logits: True" in r.stdout, r.stdout
    assert (tmp_path / "tuned" / "model.safetensors").is_file() and (tmp_path / "tuned" / "config.json").is_file()


def test_huggingface_example_two_ranks_under_torchrun(tmp_path):
    pytest.importorskip("transformers")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), str(HUGGINGFACE), "--out", str(tmp_path / "tuned")],
        env=_env(), capture_output=True, text=True, timeout=300,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "2 rank(s), 30 steps" in out and "padding row zeroed on every rank: True" in out, out
    assert "from_pretrained gives the engine's logits: True" in out, out


HF_TRAINER = ROOT / "examples" / "python" / "hf_trainer.py"
PEFT_LORA = ROOT / "examples" / "python" / "peft_lora.py"


def _torchrun(script, *args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
            "--master_port", str(port), str(script), *args]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize(
    "script,needs,expected,files",
    [
        # StrataTrainer trains, checkpoints at step 15, a second run resumes there to the
        # same last loss, save_model's output loads with from_pretrained.
        (HF_TRAINER, ["transformers", "accelerate"],
         ["resumed at step 15 to the same last loss: True", "from_pretrained gives the engine's logits: True"],
         ["config.json", "generation_config.json", "model.safetensors", "training_args.bin"]),
        # A PEFT LoRA model trains without blocks=, its base partitioned; PeftModel.from_pretrained
        # loads the saved adapters with the engine's logits.
        (PEFT_LORA, ["transformers", "peft"],
         ["held between steps: 0)", "PeftModel.from_pretrained gives the engine's logits: True"],
         ["adapter_config.json", "adapter_model.safetensors"]),
    ],
    ids=["hf_trainer", "peft_lora"],
)
def test_trainer_and_peft_examples(tmp_path, ranks, script, needs, expected, files):
    for module in needs:
        pytest.importorskip(module)
    args = ["--out", str(tmp_path / "out")]
    cmd = [sys.executable, str(script), *args] if ranks == 1 else _torchrun(script, *args)
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    for text in [f"{ranks} rank(s), 30 steps", *expected]:
        assert text in out, (text, out[-6000:])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == files
