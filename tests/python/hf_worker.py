"""One rank of test_transformers.py's two-rank case: a Hugging Face Llama causal LM trained
through strata.initialize, rank and world size from torchrun's variables.

usage: hf_worker.py OUT.json   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_model  # noqa: E402
import strata  # noqa: E402


def main():
    out = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = hf_model.make_model()
    engine, *_ = strata.initialize(model=model, config=hf_model.config(hf_model.GLOBAL_BATCH))
    micro = hf_model.GLOBAL_BATCH // world
    losses = []
    for ids in hf_model.batches(hf_model.STEPS, hf_model.GLOBAL_BATCH):
        mine = ids[rank * micro : (rank + 1) * micro]
        loss = engine(input_ids=mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {k: v.tolist() for k, v in engine.gather_parameters().items()}
    engine.close()
    with open(out, "w") as f:
        json.dump({"losses": losses, "params": params}, f)


if __name__ == "__main__":
    main()
