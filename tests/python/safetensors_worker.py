"""One rank of test_safetensors.py's two-rank case: a Hugging Face Llama model built from
another seed loads a sharded safetensors checkpoint (index + files) into strata's
partitions, then evaluates and trains one step.

usage: safetensors_worker.py OUT.json INDEX.json plain|zero_init
       (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; zero_init: built under strata.zero.Init)
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
    out, index, how = sys.argv[1], sys.argv[2], sys.argv[3]
    if how == "zero_init":
        with strata.zero.Init(meta=True):
            model = hf_model.make_model(seed=1)
    else:
        model = hf_model.make_model(seed=1)
    engine, *_ = strata.initialize(model=model, config=hf_model.config(hf_model.GLOBAL_BATCH))
    strata.load_safetensors(engine, index)
    ids = next(hf_model.batches(1, 2, seed=9))
    with torch.no_grad():
        logits = engine(input_ids=ids).logits
    params = {k: v.tolist() for k, v in engine.gather_parameters().items()}
    engine.close()
    with open(out, "w") as f:
        json.dump({"logits": logits.tolist(), "params": params}, f)


if __name__ == "__main__":
    main()
