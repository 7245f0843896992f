"""A Hugging Face transformers causal LM (Llama family, small config, random weights,
nothing downloaded) trains through strata.initialize unchanged: keyword-argument forward,
ModelOutput results, tied embeddings; its losses and parameters match torch.optim.AdamW
on the same model and data, on one rank and on two."""

import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import hf_model  # noqa: E402
import ranks  # noqa: E402


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def test_llama_one_rank_matches_adamw():
    model = hf_model.make_model()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    engine, optimizer, _, _ = strata.initialize(model=model, config=hf_model.config(hf_model.GLOBAL_BATCH))
    groups = {g["name"]: g for g in engine.groups()}
    # Each decoder layer is a block; the tied embedding stays gathered in the root group.
    assert {"model.layers.0", "model.layers.1", "model.norm"} <= set(groups), list(groups)
    root = {p[0] for p in groups["root"]["params"]}  # (name, numel, offset)
    assert "model.embed_tokens.weight" in root, root
    ref_losses, ref_model = hf_model.reference()
    for step, ids in enumerate(hf_model.batches(hf_model.STEPS, hf_model.GLOBAL_BATCH)):
        out = engine(input_ids=ids, labels=ids)
        assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithPast), type(out)
        assert out.logits.shape == (hf_model.GLOBAL_BATCH, hf_model.SEQ, hf_model.VOCAB)
        engine.backward(out.loss)
        engine.step()
        assert rel(out.loss.item(), ref_losses[step]) <= 1e-5, f"step {step}: {out.loss.item()} vs {ref_losses[step]}"
    params = engine.gather_parameters()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-4, atol=1e-6, msg=name)
    # Evaluation forward under no_grad, with ModelOutput, after training.
    with torch.no_grad():
        ids = next(hf_model.batches(1, 2, seed=9))
        out = engine(input_ids=ids)
        want = ref_model(input_ids=ids).logits
    torch.testing.assert_close(out.logits, want, rtol=1e-4, atol=1e-5)
    engine.close()


def test_llama_two_ranks_match_adamw(tmp_path):
    port = ranks.free_port()
    results = ranks.run(tmp_path, HERE / "hf_worker.py", 2, env_of=lambda r: ranks.torchrun_env(r, 2, port))
    ref_losses, ref_model = hf_model.reference()
    for step in range(hf_model.STEPS):
        mean = sum(r["losses"][step] for r in results) / 2
        assert rel(mean, ref_losses[step]) <= 1e-5, f"step {step}: {mean} vs {ref_losses[step]}"
    for name, p in ref_model.named_parameters():
        for r in results:
            torch.testing.assert_close(torch.tensor(r["params"][name]), p.detach(), rtol=1e-4, atol=1e-6, msg=name)
