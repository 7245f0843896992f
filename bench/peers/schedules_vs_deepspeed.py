"""Strata's LR schedules against DeepSpeed's own, step by step.

For each schedule below (every DeepSpeed type, with log and linear warm-up, staircases,
momentum cycling and a resumed last_batch_iteration) it builds DeepSpeed's scheduler
class from deepspeed.runtime.lr_schedules over a torch optimizer and steps it as
DeepSpeed's engine does (the optimizer step uses the group's lr and betas, then
lr_scheduler.step()), and compares every step's (lr, beta1, beta2) with what Strata's
engine uses (strata._strata.lr_schedule, engine/step/lr_schedule.h). Prints the largest
relative difference per schedule; exits 1 if any exceeds 1e-12.

One difference is by design: resumed at last_batch_iteration L with a fresh optimizer,
DeepSpeed's first step uses the optimizer's configured lr (its schedulers set the rate in
the constructor only when L = -1), while Strata's uses the uninterrupted run's rate at
step L + 1. For those schedules step 0 is printed, not compared.

usage: .venv/bin/python bench/peers/schedules_vs_deepspeed.py [--steps N]
(needs bench/peers/install.sh)
"""

import argparse
import json
import os
import sys

SCHEDULES = [
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_max_lr": 3e-3, "warmup_num_steps": 40}),
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 25,
                  "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 30,
                  "last_batch_iteration": 11}),
    ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-3, "warmup_num_steps": 20,
                       "total_num_steps": 150}),
    ("WarmupCosineLR", {"total_num_steps": 150, "warmup_num_steps": 20, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 100, "warmup_num_steps": 10, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 30,
                  "decay_step_size": 10, "decay_lr_rate": 0.1, "decay_mom_rate": 0.05}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2, "cycle_first_step_size": 30,
                  "cycle_second_step_size": 50, "cycle_first_stair_count": 5,
                  "cycle_momentum": False}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10,
                     "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 10,
                     "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}),
]

LR, BETAS = 1e-3, (0.9, 0.999)


def deepspeed_steps(torch, lr_schedules, kind, params, steps):
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS)
    sched = getattr(lr_schedules, kind)(opt, **params)
    out = []
    for _ in range(steps):
        group = opt.param_groups[0]
        out.append((group["lr"], group["betas"][0], group["betas"][1]))
        sched.step()  # DeepSpeed's engine: after the optimizer's step
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    try:
        import deepspeed
        from deepspeed.runtime import lr_schedules
    except ImportError as e:
        sys.exit(f"schedules_vs_deepspeed: DeepSpeed is not installed ({e}); run bench/peers/install.sh")
    from strata import _strata

    print(f"schedules_vs_deepspeed: deepspeed {deepspeed.__version__}, {args.steps} steps each")
    worst = 0.0
    for kind, params in SCHEDULES:
        cfg = {"train_batch_size": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS)}},
               "scheduler": {"type": kind, "params": params}}
        ours = _strata.lr_schedule(json.dumps(cfg), args.steps)
        theirs = deepspeed_steps(torch, lr_schedules, kind, params, args.steps)
        diff, at = 0.0, 0
        first = 1 if "last_batch_iteration" in params else 0
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if i < first:
                continue
            for x, y in zip(a, b):
                d = abs(x - y) / max(abs(y), 1e-300) if y != 0 else abs(x)
                if d > diff:
                    diff, at = d, i
        worst = max(worst, diff)
        verdict = "ok" if diff <= 1e-12 else f"DIFFERS at step {at}: strata {ours[at]} deepspeed {theirs[at]}"
        print(f"{kind:<15} {json.dumps(params)}\n    max relative difference {diff:.3g}"
              f"{' (steps 1 on)' if first else ''}: {verdict}")
        if first:
            print(f"    step 0 (resumed; by design): strata lr {ours[0][0]:.6g}, deepspeed lr {theirs[0][0]:.6g}")
    sys.exit(0 if worst <= 1e-12 else 1)


if __name__ == "__main__":
    main()
