"""One rank of the multi-rank engine tests (started by test_engine.py).

usage: engine_worker.py OUT.json STEPS GLOBAL_BATCH MODE [RANK WORLD PORT]
MODE env (groups, lamb: the same with toy_model's parameter-group recipe, under AdamW or Lamb;
stage1, stage2: the same under ZeRO stage 1 or 2): rank and world size from torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), the rendezvous through strata's own store. MODE torch_dist: the worker first
initializes torch.distributed (gloo, tcp://127.0.0.1:PORT) and strata.initialize reuses
its store, rank and world size.
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402
import toy_model  # noqa: E402


def main():
    out, steps, global_batch, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    if mode == "torch_dist":
        rank, world, port = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    model = toy_model.make_model()
    if mode == "groups":  # torchrun's variables, and the fine-tuning recipe's parameter groups
        engine, _, _, _ = strata.initialize(
            model=model, config=toy_model.recipe_config(global_batch, world),
            model_parameters=toy_model.recipe_groups(model)
        )
    elif mode == "lamb":  # the recipe's groups under Lamb
        engine, _, _, _ = strata.initialize(
            model=model, config=toy_model.lamb_config(global_batch, world),
            model_parameters=toy_model.recipe_groups(model)
        )
    elif mode in ("stage1", "stage2"):  # torchrun's variables, ZeRO stage 1 or 2
        cfg = toy_model.config(global_batch, world)
        cfg["zero_optimization"]["stage"] = int(mode[-1])
        engine, _, _, _ = strata.initialize(model=model, config=cfg)
    else:
        engine, _, _, _ = strata.initialize(model=model, config=toy_model.config(global_batch, world))
    assert engine.rank == rank and engine.world_size == world
    assert engine.global_rank == rank, (engine.global_rank, rank)
    losses = toy_model.train_slice(engine, rank, world, steps, global_batch)
    params = {k: v.tolist() for k, v in engine.gather_parameters().items()}
    stats = engine.statistics()
    with open(out, "w") as f:
        json.dump({"losses": losses, "params": params, "master_bytes": stats["optimizer"]["master_bytes"],
                   "reduce_lane": stats["reduce_lane"], "gather_lane": stats["gather_lane"],
                   "cpu_adam": [stats[k] for k in ("cpu_adam_threads", "cpu_adam_cores", "cpu_adam_ranks_sharing")]},
                  f)
    engine.close()
    if mode == "torch_dist":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
