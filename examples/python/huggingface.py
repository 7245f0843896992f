"""Fine-tuning a Hugging Face model with Strata, from from_pretrained to save_pretrained
(docs/huggingface.md), run by tests/python/test_examples.py on a tiny random Llama so that it
stays true. Nothing is downloaded: the "pretrained" model is one this script first writes
with transformers' own save_pretrained (in real use it is a directory you downloaded).

    PYTHONPATH=build/python .venv/bin/python examples/python/huggingface.py --out /tmp/tuned
    PYTHONPATH=build/python .venv/bin/torchrun --nproc_per_node 2 examples/python/huggingface.py --out /tmp/tuned

Exit status 0 when the loss fell below 70% of the first and the saved model, loaded back with from_pretrained,
gives the engine's logits exactly.
"""

import argparse
import os
import tempfile

import torch
import transformers  # before strata.zero.Init, which then routes its from_pretrained

import strata
from tiny_base import base_model, batches


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="where the tuned model is saved (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # Every rank needs the same directories: derive them from --out when given.
    out = args.out or os.path.join(tempfile.gettempdir(), "strata-hf-example-out")
    base = base_model(out, rank, torch.bfloat16)  # written by rank 0, waited for by the others
    # [huggingface]
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    # Under strata.zero.Init no rank holds the model: from_pretrained builds it from its config
    # and strata.initialize reads each rank's slices of the weights.
    with strata.zero.Init(config):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    engine, optimizer, _, _ = strata.initialize(model=model, config=config)
    engine.train()

    losses = []
    for step, ids in enumerate(batches(args.steps, 4, 32, engine.rank, engine.world_size)):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if step == args.steps // 2:
            # A change to the weights after initialize: the padding token's embedding zeroed,
            # whole on every rank inside the context, rank 0's change written back on exit.
            emb = model.model.embed_tokens.weight
            with strata.zero.GatheredParameters(emb, modifier_rank=0):
                if engine.rank == 0:
                    with torch.no_grad():
                        emb[model.config.pad_token_id].zero_()
            with strata.zero.GatheredParameters(emb):  # every rank sees rank 0's change
                zeroed = bool((emb[model.config.pad_token_id] == 0).all())

    # The Hugging Face layout (config.json, model.safetensors): rank 0 writes, streamed.
    engine.save_pretrained(out)
    # [huggingface]
    engine.eval()
    probe = next(batches(1, 2, 32, 0, 1))
    with torch.no_grad():
        want = engine(input_ids=probe).logits
    engine.close()
    ok = losses[-1] < 0.7 * losses[0]
    if rank == 0:
        back = transformers.AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            same = torch.equal(back(input_ids=probe).logits, want)
        ok = ok and same
        print(f"huggingface.py: {world} rank(s), {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"padding row zeroed on every rank: {zeroed}, saved to {out}, "
              f"from_pretrained gives the engine's logits: {same}")
    ok = ok and zeroed
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
