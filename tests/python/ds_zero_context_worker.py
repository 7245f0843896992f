"""One rank of test_ds_zero_context.py's 2-rank cases (DeepSpeed's TestScatterGather and
TestGatherUpdate), under torch.distributed (gloo) as DeepSpeed's Init runs.

usage: ds_zero_context_worker.py OUT.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402
from strata.zero import partitioned  # noqa: E402


def scatter_gather():
    with strata.zero.Init():
        lin = torch.nn.Linear(6, 3)
    checks = {"partitioned": partitioned(lin.weight) is not None and lin.weight.numel() == 0}
    lin2 = torch.nn.Linear(6, 3)  # no impact outside the context
    checks["outside_plain"] = partitioned(lin2.weight) is None and lin2.weight.numel() == 18
    with strata.zero.GatheredParameters(lin.weight):
        checks["gathered_whole"] = lin.weight.numel() == lin.in_features * lin.out_features
    return checks


def gather_update():
    with strata.zero.Init():
        lin = torch.nn.Linear(4, 2)
    with strata.zero.GatheredParameters(lin.weight, modifier_rank=1):
        if dist.get_rank() == 1:
            with torch.no_grad():
                lin.weight.zero_()
    with strata.zero.GatheredParameters(lin.weight):
        return {"zeros_everywhere": torch.equal(lin.weight, torch.zeros_like(lin.weight))}


def main(out):
    dist.init_process_group("gloo")
    result = {"scatter_gather": scatter_gather(), "gather_update": gather_update()}
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
