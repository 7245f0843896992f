"""LoRA fine-tuning of a PEFT model on Strata (docs/huggingface.md, "PEFT"), run by
tests/python/test_examples.py on a tiny random Llama so that it stays true. Nothing is
downloaded: the "pretrained" base is one this script first writes with transformers' own
save_pretrained (in real use, a directory you downloaded).

    PYTHONPATH=build/python .venv/bin/python examples/python/peft_lora.py --out /tmp/adapter
    PYTHONPATH=build/python .venv/bin/torchrun --nproc_per_node 2 examples/python/peft_lora.py --out /tmp/adapter

No blocks= needed: the decoder layers are the blocks, their frozen base weights partitioned
across the ranks and gathered only around their use; only the adapters have optimizer state.
Exit status 0 when the loss fell below 95% of the first (adapters on a random base learn
slowly: about 5.56 -> 5.04 in 30 steps), no decoder-layer weight is held between steps, and
PeftModel.from_pretrained, on a fresh base, gives the engine's logits from the saved adapters.
"""

import argparse
import os
import tempfile

import peft
import torch
import transformers

import strata
from tiny_base import base_model, batches


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="where the adapters are saved (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    out = args.out or os.path.join(tempfile.gettempdir(), "strata-peft-example-out")
    base = base_model(out, rank)  # written by rank 0, waited for by the others
    # [peft]
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
    torch.manual_seed(2)  # the adapters' initial values, the same on every rank
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base), lora)
    config = {
        "train_micro_batch_size_per_gpu": 8 // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "cpu"}},
    }
    engine, _, _, _ = strata.initialize(model=model, config=config)  # no blocks=: the decoder layers
    losses = []
    for ids in batches(args.steps, 8 // world, 32, engine.rank, engine.world_size):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_pretrained(out)  # adapter_model.safetensors and adapter_config.json, as PEFT writes them
    # [peft]
    frozen = sum(g["numel"] for g in engine.groups() if g["frozen"])
    master = engine.statistics()["optimizer"]["master_bytes"]
    held = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n)
    probe = next(batches(1, 2, 32, 0, 1))
    with torch.no_grad():
        want = engine(input_ids=probe).logits
    engine.close()
    ok = losses[-1] < 0.95 * losses[0] and held == 0
    if rank == 0:
        back = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), out)
        with torch.no_grad():
            same = torch.allclose(back(input_ids=probe).logits, want, rtol=1e-5, atol=1e-5)
        ok = ok and same
        print(f"peft_lora.py: {world} rank(s), {len(losses)} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
              f"frozen base {frozen} elements partitioned (decoder-layer elements held between steps: {held}), "
              f"optimizer master {master} bytes on this rank, adapters saved to {out}, "
              f"PeftModel.from_pretrained gives the engine's logits: {same}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
