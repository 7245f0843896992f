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
def test_hf_trainer_example(tmp_path, ranks):
    """examples/python/hf_trainer.py: StrataTrainer trains, checkpoints at step 15, a second
    run resumes there to the same last loss, save_model's output loads with from_pretrained."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = ["--out", str(tmp_path / "trained")]
    cmd = [sys.executable, str(HF_TRAINER), *args] if ranks == 1 else _torchrun(HF_TRAINER, *args)
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert f"{ranks} rank(s), 30 steps" in out and "resumed at step 15 to the same last loss: True" in out, out[-6000:]
    assert "from_pretrained gives the engine's logits: True" in out, out[-6000:]
    assert (tmp_path / "trained" / "model.safetensors").is_file()


@pytest.mark.parametrize("ranks", [1, 2])
def test_peft_lora_example(tmp_path, ranks):
    """examples/python/peft_lora.py: a PEFT LoRA model trains without blocks=, its base
    partitioned; PeftModel.from_pretrained loads the saved adapters with the engine's logits."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    args = ["--out", str(tmp_path / "adapter")]
    cmd = [sys.executable, str(PEFT_LORA), *args] if ranks == 1 else _torchrun(PEFT_LORA, *args)
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert f"{ranks} rank(s), 30 steps" in out and "held between steps: 0)" in out, out[-6000:]
    assert "PeftModel.from_pretrained gives the engine's logits: True" in out, out[-6000:]
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
