"""One rank of test_zero_init_deepspeed.py's multi-rank cases, under torch.distributed (gloo)
as DeepSpeed's Init runs: a constructor that sets values per rank (rank 0's must win, as
DeepSpeed's broadcast gives), and DeepSpeed's "fill on rank 0" recipe with
GatheredParameters(modifier_rank=0) on parts before strata.initialize, inside a module's
__init__ and after construction (and without a modifier: dropped).

usage: zero_init_ds_worker.py OUT.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402


class PerRank(torch.nn.Module):
    def __init__(self, rank):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((7,), float(rank + 1)))  # differs per rank
        self.linear = torch.nn.Linear(4, 3)
        # DeepSpeed's recipe inside __init__: fill on rank 0, every rank enters.
        with strata.zero.GatheredParameters(self.linear.bias, modifier_rank=0), torch.no_grad():
            if rank == 0:
                self.linear.bias.copy_(torch.tensor([10.0, 20.0, 30.0]))

    def forward(self, x):
        return (self.linear(x).sum(-1, keepdim=True) * self.w[:1]).sum()


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with strata.zero.Init():
        model = PerRank(rank)
    # After construction, before initialize.
    with strata.zero.GatheredParameters(model.linear.weight, modifier_rank=0), torch.no_grad():
        seen_whole = list(model.linear.weight.shape)
        if rank == 0:
            model.linear.weight.copy_(torch.arange(12.0).reshape(3, 4))
    with strata.zero.GatheredParameters(model.w), torch.no_grad():  # no modifier: changes dropped
        model.w.fill_(99.0)
    engine, *_ = strata.initialize(model=model, config={"train_batch_size": world, "zero_optimization": {"stage": 3}})
    values = {k: v.tolist() for k, v in engine.gather_parameters().items()}
    engine.close()
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"values": values, "seen_whole": seen_whole}, f)


if __name__ == "__main__":
    main(sys.argv[1])
