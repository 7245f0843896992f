"""One rank of test_ds_zero_optimizer.py (DeepSpeed's tests/unit/checkpoint/
test_zero_optimizer.py, ported): each case trains, saves and loads on this rank's slice.

usage: ds_zero_optimizer_worker.py OUT.json CASE DIR
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
    """DeepSpeed's SimpleModel (two linears and a loss); ``frozen``: the first linear frozen
    (its SimpleFrozenModel)."""

    def __init__(self, frozen=False):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        if frozen:
            self.linears[0].requires_grad_(False)

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x, y)


def engine_of(seed, world, frozen=False, cpu_offload=True, accumulation=1, under_init=False):
    torch.manual_seed(seed)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
           "train_batch_size": world * accumulation, "steps_per_print": 1,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": 3, **({"offload_optimizer": {"device": "cpu"}} if cpu_offload else {})}}
    if under_init:
        with strata.zero.Init(config_dict_or_path=cfg):
            model = Simple(frozen)
    else:
        model = Simple(frozen)
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def batch(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(1, HIDDEN, generator=g), torch.randint(0, HIDDEN, (1,), generator=g)


def train(engine, steps, rank, first=0):
    for s in range(first, first + steps):
        engine.backward(engine(*batch(s, rank)))
        engine.step()


def same(a, b):
    pa, pb = a.gather_parameters(), b.gather_parameters()
    return all(torch.equal(pa[n], pb[n]) for n in pa)


def next_loss(engine, rank):
    train(engine, 1, rank, first=50)
    with torch.no_grad():
        return engine(*batch(51, rank)).item()


def case(name, rank, world, d):
    out = {}
    if name in ("load_optimizer_state", "not_load_optimizer_state", "load_module_only", "frozen"):
        frozen = name == "frozen"
        a = engine_of(0, world, frozen=frozen)
        train(a, 3, rank)
        a.save_checkpoint(d)
        b = engine_of(1, world, frozen=frozen)
        kwargs = {"load_optimizer_states": name != "not_load_optimizer_state",
                  "load_module_only": name == "load_module_only"}
        b.load_checkpoint(d, **kwargs)
        out["same_parameters"] = same(a, b)
        out["next_losses"] = [next_loss(a, rank), next_loss(b, rank)]
    elif name == "pipeline_checkpoint_loading":  # models built under zero.Init, module only
        a = engine_of(0, world, under_init=True)
        train(a, 2, rank)
        a.save_checkpoint(d)
        b = engine_of(1, world, under_init=True)
        b.load_checkpoint(d, load_module_only=True)
        out["same_parameters"] = same(a, b)
    elif name == "immediate_save_load":
        a = engine_of(0, world)
        a.save_checkpoint(d)
        path, _ = a.load_checkpoint(d, load_optimizer_states=False, load_lr_scheduler_states=False,
                                    load_module_only=False)
        out["loaded"] = path is not None
    elif name == "load_immediate_save":
        a = engine_of(0, world)
        train(a, 1, rank)
        a.empty_partition_cache()
        a.save_checkpoint(d)
        b = engine_of(0, world)
        b.load_checkpoint(d, load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=False)
        out["same_parameters"] = same(a, b)
        try:  # DeepSpeed overwrites global_step1; a Strata checkpoint is never overwritten
            b.save_checkpoint(d)
            out["again"] = "saved"
        except FileExistsError as exc:
            out["again"] = str(exc)
        out["new_tag"] = b.save_checkpoint(d, tag="after_load").endswith("after_load")
    elif name == "exclude_frozen":
        a = engine_of(0, world, frozen=True)
        train(a, 2, rank)
        full = a.save_checkpoint(os.path.join(d, "all_params"))
        slim = a.save_checkpoint(os.path.join(d, "no_frozen_params"), exclude_frozen_parameters=True)
        size = lambda p: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(p) for f in fs)  # noqa: E731
        out["smaller"] = size(slim) < size(full)
        b = engine_of(0, world, frozen=True)  # the same base
        b.load_checkpoint(os.path.join(d, "no_frozen_params"))
        out["same_parameters"] = same(a, b)
    elif name == "save_before_accum_grad_is_done":
        a = engine_of(0, world, accumulation=2)
        train(a, 1, rank)
        try:
            a.save_16bit_model(d, "model.safetensors")
            out["16bit"] = "saved"
        except RuntimeError as exc:
            out["16bit"] = str(exc)
        try:
            a.save_checkpoint(d)
            out["checkpoint"] = "saved"
        except RuntimeError as exc:
            out["checkpoint"] = str(exc)
    return out


if __name__ == "__main__":
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    result = case(sys.argv[2], rank, world, sys.argv[3])
    with open(sys.argv[1], "w") as f:
        json.dump(result, f)
