"""One rank of test_ds_latest_checkpoint.py (DeepSpeed's test_latest_checkpoint.py, ported).

usage: ds_checkpoint_worker.py OUT.json CASE CHECKPOINT_DIR
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402

HIDDEN = 10


class Simple(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.linear(x), y)


def engine_of(seed, world):
    torch.manual_seed(seed)
    model = Simple()
    cfg = {"train_batch_size": 2 * world, "steps_per_print": 1, "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
           "zero_optimization": {"stage": 3}}
    engine, *_ = strata.initialize(config=cfg, model=model, model_parameters=model.parameters())
    return engine


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(2, HIDDEN, generator=g), torch.randint(0, HIDDEN, (2,), generator=g)


def main(out, case, ckpt):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = {}
    if case == "missing_latest":
        engine = engine_of(0, world)
        result["loaded"] = list(engine.load_checkpoint(ckpt))  # no-op: nothing saved there
        engine.close()
    else:
        first = engine_of(0, world)
        for step in range(2):
            first.backward(first(*batch(step, rank)))
            first.step()
        first.save_checkpoint(ckpt)  # no tag: global_step2, and latest names it
        second = engine_of(1, world)
        result["loaded"] = [second.load_checkpoint(ckpt)[0], None]
        a, b = first.gather_parameters(), second.gather_parameters()
        result["same_parameters"] = all(torch.equal(a[n], b[n]) for n in a)
        losses = []
        for engine in (first, second):
            loss = engine(*batch(2, rank))
            engine.backward(loss)
            engine.step()
            with torch.no_grad():  # after the step: the optimizer states agreed
                losses.append(engine(*batch(3, rank)).item())
        result["next_loss"] = losses
        first.close()
        second.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
