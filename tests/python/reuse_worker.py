"""One rank of test_initialize_reuse.py: strata.initialize fails, on one rank or on every
rank, and the same model is then wrapped again and trained.

usage: reuse_worker.py OUT.json SCENARIO TMPDIR
  monitor:  rank 0 cannot open its csv_monitor directory (its own failure, before any
            collective): every rank agrees on it before the engine takes anything
  injected: every rank fails after the engine took the values (an injected error where the
            optimizer is made): the values come back through a gather
Each rank writes whether its model kept its values and the losses of 3 steps trained
afterwards on its slice of the batch.
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402
import strata.engine  # noqa: E402
import toy_model  # noqa: E402

GLOBAL_BATCH, STEPS = 8, 3


def config(world):
    cfg = toy_model.config(GLOBAL_BATCH, world)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}}
    return cfg


def main(out, scenario, tmp):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = toy_model.make_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    error = None
    if scenario == "monitor":
        bad = {**config(world), "csv_monitor": {"enabled": True, "output_path": "/proc/no-such-dir"}}
        try:
            strata.initialize(model=model, config=bad)
        except Exception as exc:  # noqa: BLE001: what each rank saw is the result
            error = f"{type(exc).__name__}: {exc}"
    else:
        original = strata.engine.EngineOptimizer.__init__

        def injected(self, *args, **kwargs):
            raise RuntimeError("injected after the engine took the values")

        strata.engine.EngineOptimizer.__init__ = injected
        try:
            strata.initialize(model=model, config=config(world))
        except RuntimeError as exc:
            error = str(exc)
        finally:
            strata.engine.EngineOptimizer.__init__ = original
    kept = all(torch.equal(before[n], p) for n, p in model.named_parameters())
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    engine, *_ = strata.initialize(model=model, config=config(world))
    losses = toy_model.train_slice(engine, rank, world, STEPS, GLOBAL_BATCH)
    engine.close()
    with open(out, "w") as f:
        json.dump({"error": error, "kept": kept, "hooks": hooks, "losses": losses}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
