"""Run by test_engine.py::test_initialize_copies_no_parameter_of_a_cpu_model in its own
process: a model of one frozen 96 MiB bf16 parameter (and a small trained one) through
strata.initialize with the parameters offloaded to the CPU; prints the model's bytes and
the process's peak resident set before and after (ru_maxrss)."""
import json, resource, sys
import torch
import strata

torch.set_num_threads(1)
n = 48 * 2**20  # 96 MiB of bf16


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Parameter(torch.full((n,), 0.5, dtype=torch.bfloat16), requires_grad=False)
        self.w = torch.nn.Parameter(torch.ones(16))

    def forward(self, x):
        return (x * self.w).sum() + self.base[:16].float().sum()


def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


m = M()
before_peak, before = peak(), rss()
cfg = {
    "train_batch_size": 4,
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
    "strata": {"device_budget": 2 * n * 2 + (64 << 20)},
}
engine, *_ = strata.initialize(model=m, config=cfg)
print(json.dumps({"model": n * 2, "before_rss": before, "before_peak": before_peak, "after_peak": peak(), "after_rss": rss()}))
