"""What sizing from the model (core/sizing.h) does to a rank's memory and step time.

Each variant runs in a process of its own on one rank: a model of L blocks of one D x D
fp32 Linear each, built plainly, through strata.initialize with the optimizer and the
parameters offloaded to the CPU, then S training steps. Variants:
  sized      reduce_bucket_size and sub_group_size left out: the engine sizes them
  deepspeed  the same keys written out at DeepSpeed's defaults (5e8, 1e9): kept as given
Printed per variant: the resident set's growth through initialize (peak, and after), the
engine's host and device tiers, and the median step time; the variants are interleaved,
R rounds, medians reported (the machine is shared and noisy).

    .venv/bin/python bench/default_sizes.py [--d 2048] [--layers 16] [--steps 6] [--rounds 3]

Needs the built package on PYTHONPATH (build/python).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(variant, d, layers, steps):
    import torch
    import strata

    torch.set_num_threads(2)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(d, d, bias=False)

        def forward(self, x):
            return torch.relu(self.fc(x)) + x

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.pow(2).mean()

    cfg = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "offload_param": {"device": "cpu"}}}
    if variant == "deepspeed":
        cfg["zero_optimization"].update({"reduce_bucket_size": 500000000, "sub_group_size": 1000000000})
    torch.manual_seed(0)
    model = Model()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from here
    before = status("VmRSS")
    engine, *_ = strata.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    init_peak, init_after = status("VmHWM") - before, status("VmRSS") - before
    x = torch.randn(8, 64, d)
    times, loss = [], None
    for _ in range(steps):
        t = time.perf_counter()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
    stats = engine.statistics()
    out = {"init_peak": init_peak, "init_after": init_after, "train_peak": status("VmHWM") - before,
           "host_tier": stats["host"]["peak_bytes"], "device_tier": stats["device"]["peak_bytes"],
           "step_s": statistics.median(times[1:]), "loss": float(loss.detach())}
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=["sized", "deepspeed"])
    a = ap.parse_args()
    if a.child:
        child(a.child, a.d, a.layers, a.steps)
        return
    runs = {"sized": [], "deepspeed": []}
    for _ in range(a.rounds):
        for v in runs:
            p = subprocess.run([sys.executable, __file__, "--child", v, "--d", str(a.d), "--layers", str(a.layers),
                                "--steps", str(a.steps)], capture_output=True, text=True, check=True)
            runs[v].append(json.loads(p.stdout.strip().splitlines()[-1]))
    params = a.d * a.d * a.layers
    print(f"model: {params} parameters ({a.layers} blocks of {a.d}x{a.d}, fp32), 1 rank, optimizer and "
          f"parameters offloaded to the CPU; medians of {a.rounds} interleaved rounds")
    print(f"{'variant':<10} {'init peak':>11} {'init after':>11} {'train peak':>11} {'host tier':>10} "
          f"{'device tier':>11} {'B/param':>8} {'step s':>7}  loss")
    summary = {}
    for v, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        summary[v] = med
        mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
        print(f"{v:<10} {mib(med['init_peak']):>11} {mib(med['init_after']):>11} {mib(med['train_peak']):>11} "
              f"{mib(med['host_tier']):>10} {mib(med['device_tier']):>11} {med['train_peak'] / params:>8.1f} "
              f"{med['step_s']:>7.3f}  {med['loss']:.6g}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
