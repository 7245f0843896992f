"""PEFT on Strata: a peft LoRA model on a small random Llama trains through
strata.initialize without blocks= (the decoder layers are the blocks, the frozen base is
partitioned and gathered only around its use), as torch.optim.AdamW over the adapters; and
engine.save_pretrained writes what PeftModel.save_pretrained writes, which
PeftModel.from_pretrained loads with the same logits. Nothing downloaded."""

import json
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import hf_model  # noqa: E402

STEPS = 5


def lora_model(seed=0):
    model = hf_model.make_model(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(seed + 1)  # the adapters' initial values
    return peft.get_peft_model(model, config)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def test_a_peft_lora_model_trains_without_blocks_and_saves_its_adapters(tmp_path):
    ref = lora_model()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    model = lora_model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    layer_base = [
        (n, p.numel()) for n, p in model.named_parameters() if ".layers." in n and not p.requires_grad
    ]
    engine, *_ = strata.initialize(model=model, config=hf_model.config(hf_model.GLOBAL_BATCH, lr=1e-2))

    # The decoder layers are the blocks (not the adapters' ModuleDicts), the final norm a
    # block of frozen parameters; the tied embedding is the root's.
    names = [g["name"] for g in engine.groups()]
    prefix = "base_model.model.model."
    assert names == [
        "root", prefix + "layers.0", prefix + "layers.1", prefix + "norm", "root:frozen",
        prefix + "layers.0:frozen", prefix + "layers.1:frozen", prefix + "norm:frozen",
    ], names
    layout = {g["name"]: g for g in engine.groups()}
    assert layout[prefix + "layers.0:frozen"]["frozen"]
    # Only the adapters have optimizer state: fp32 master, m and v (plus alignment).
    assert engine.statistics()["optimizer"]["master_bytes"] <= (trainable + 64 * len(names)) * 4

    for step, ids in enumerate(hf_model.batches(STEPS, hf_model.GLOBAL_BATCH)):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        ref_loss = ref(input_ids=ids, labels=ids).loss
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        assert rel(loss.item(), ref_loss.item()) <= 1e-5, (step, loss.item(), ref_loss.item())
        # The frozen base of every layer is partitioned: released between steps.
        held = {n: p.numel() for n, p in model.named_parameters() if ".layers." in n and p.numel()}
        assert not held, held
    assert layer_base and all(numel > 0 for _, numel in layer_base)

    # Adapters only, as PEFT writes them.
    out = tmp_path / "adapter"
    engine.save_pretrained(out)
    ref.save_pretrained(tmp_path / "ref")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    got, want = load_file(out / "adapter_model.safetensors"), load_file(tmp_path / "ref" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
    # The same JSON as peft's, but for the order of a set's list (peft writes a set in its
    # iteration order, which follows the process's string hash seed; Strata writes it sorted).
    ours = json.loads((out / "adapter_config.json").read_text())
    theirs = json.loads((tmp_path / "ref" / "adapter_config.json").read_text())
    assert ours["target_modules"] == sorted(theirs["target_modules"]), ours["target_modules"]
    ours["target_modules"] = theirs["target_modules"] = None
    assert ours == theirs

    # PeftModel.from_pretrained on a fresh base gives the trained model's logits.
    loaded = peft.PeftModel.from_pretrained(hf_model.make_model(0), out)
    ids = next(hf_model.batches(1, 2, seed=7))
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ref(input_ids=ids).logits, logits, rtol=1e-5, atol=1e-5)
    engine.close()


def test_save_pretrained_of_a_peft_model_refuses_what_it_cannot_write(tmp_path):
    engine, *_ = strata.initialize(model=lora_model(), config=hf_model.config(hf_model.GLOBAL_BATCH))
    with pytest.raises(ValueError, match="no adapter \\['other'\\]"):
        engine.save_pretrained(tmp_path / "a", selected_adapters=["other"])
    with pytest.raises(ValueError, match="push_to_hub"):
        engine.save_pretrained(tmp_path / "a", push_to_hub=True)
    with pytest.raises(ValueError, match="safetensors only"):
        engine.save_pretrained(tmp_path / "a", safe_serialization=False)
    assert not (tmp_path / "a").exists()
    engine.close()
