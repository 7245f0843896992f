"""One rank of test_huggingface.py's two-rank case: a Llama loaded with
from_pretrained under strata.zero.Init (nothing but its shapes held until strata.initialize
reads this rank's slices), trained, changed under GatheredParameters with rank 1 as the
modifier, trained on, saved with save_pretrained; the evaluation logits after.

usage: hf_io_worker.py OUT.json BASE_DIR SAVE_DIR   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_model  # noqa: E402
import strata  # noqa: E402
import transformers  # noqa: E402


def main():
    out, base, save = sys.argv[1:4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = hf_model.config(hf_model.GLOBAL_BATCH)
    cfg["bf16"] = {"enabled": True}
    with strata.zero.Init(cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    built_on_meta = all(p.is_meta for p in model.parameters())
    engine, *_ = strata.initialize(model=model, config=cfg)
    engine.train()
    micro = hf_model.GLOBAL_BATCH // world
    losses = []

    def train(steps, seed):
        for ids in hf_model.batches(steps, hf_model.GLOBAL_BATCH, seed=seed):
            mine = ids[rank * micro : (rank + 1) * micro]
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())

    train(2, seed=1)
    norm = model.model.norm.weight
    with strata.zero.GatheredParameters([norm, model.model.layers[1].mlp.down_proj.weight], modifier_rank=1):
        whole = list(norm.shape) == [hf_model.HIDDEN]
        with torch.no_grad():
            # Rank 1's change is kept; rank 0's is dropped.
            norm.fill_(0.5 if rank == 1 else 9.0)
            model.model.layers[1].mlp.down_proj.weight[:, :4].zero_()
    after = engine.gather_parameters()
    changed = bool((after["model.norm.weight"] == 0.5).all()) and bool(
        (after["model.layers.1.mlp.down_proj.weight"][:, :4] == 0).all()
    )
    train(2, seed=2)
    saved = engine.save_pretrained(save, max_shard_size=20_000)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=next(hf_model.batches(1, 2, seed=9))).logits
    engine.close()
    with open(out, "w") as f:
        json.dump({"losses": losses, "built_on_meta": built_on_meta, "whole": whole, "changed": changed,
                   "files": saved["files"], "logits": logits.float().tolist()}, f)


if __name__ == "__main__":
    main()
