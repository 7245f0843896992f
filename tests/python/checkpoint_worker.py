"""One rank of test_checkpoint.py's runs: a small model with a frozen parameter, a buffer
its forward updates, dropout (torch's generator) and batches drawn with Python's `random`,
trained for steps [FROM, TO), loading a checkpoint first and saving one at the end.

usage: checkpoint_worker.py OUT.json SEED FROM TO LOAD_DIR|- SAVE_DIR|- PRECISION OFFLOAD [FROZEN]
       (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set for several ranks; PRECISION fp32,
       bf16 or fp16; OFFLOAD cpu or an NVMe directory for the optimizer states; FROZEN
       `exclude` saves with exclude_frozen_parameters, `unchecked` loads with
       check_frozen_parameters=False, `try` records a load's ValueError and trains nothing;
       default `keep`)
"""

import json
import os
import random
import sys

import torch

torch.set_num_threads(1)
import strata  # noqa: E402

VOCAB, DIM, SEQ, GLOBAL_BATCH = 32, 16, 8, 4


class Net(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, DIM), torch.nn.GELU()) for _ in range(2)]
        )
        self.scale = torch.nn.Parameter(torch.rand(DIM) + 0.5, requires_grad=False)
        self.register_buffer("running", torch.zeros(DIM))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        h = torch.nn.functional.dropout(h * self.scale.to(h.dtype), 0.2, self.training)
        with torch.no_grad():
            self.running.mul_(0.9).add_(h.float().mean((0, 1)), alpha=0.1)
        return self.head(h + self.running.to(h.dtype))


def config(world, precision, offload):
    c = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": 3, "sub_group_size": 300, "offload_optimizer": {"device": "cpu"}},
    }
    if precision == "bf16":
        c["bf16"] = {"enabled": True}
    if precision == "fp16":
        c["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    if offload != "cpu":
        c["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme", "nvme_path": offload, "buffer_count": 8, "pipeline_read": True,
            "pipeline_write": True,
        }
        c["aio"] = {"block_size": 4096}
    return c


def main():
    out, seed, first, last, load, save, precision, offload = sys.argv[1:9]
    frozen = sys.argv[9] if len(sys.argv) > 9 else "keep"
    first, last = int(first), int(last)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    random.seed(1234)
    model = Net(int(seed))
    engine, *_ = strata.initialize(model=model, config=config(world, precision, offload))
    result = {}
    if load != "-":
        try:
            path, client = engine.load_checkpoint(load, check_frozen_parameters=frozen != "unchecked")
            result["path"] = path
            result["client_state"] = {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in client.items()}
        except ValueError as exc:
            if frozen != "try":
                raise
            result["load_error"] = str(exc)
            last = first
    losses = []
    for _ in range(first, last):
        rows = [[random.randrange(VOCAB) for _ in range(SEQ)] for _ in range(GLOBAL_BATCH)]
        x = torch.tensor(rows)
        y = (x * 3 + 1) % VOCAB
        micro = GLOBAL_BATCH // world
        xs, ys = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
        logits = engine(xs)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ys.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if save != "-":
        result["saved"] = engine.save_checkpoint(
            save,
            client_state={"position": last, "rank": rank, "t": torch.arange(3) * rank},
            exclude_frozen_parameters=frozen == "exclude",
        )
    result["losses"] = losses
    result["params"] = {k: v.tolist() for k, v in engine.gather_parameters().items()}
    result["running"] = model.running.tolist()
    result["loss_scale"] = engine.statistics()["loss_scale"]
    result["lr"] = engine.get_lr()
    engine.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
