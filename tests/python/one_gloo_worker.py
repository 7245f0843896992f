"""One rank of test_one_gloo.py: torch.distributed's Gloo collectives and Strata's
collectives in one process, then what the process has mapped.

usage: one_gloo_worker.py OUT.json RANK WORLD PORT
"""

import json
import os
import re
import subprocess
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402
import toy_model  # noqa: E402

STEPS, GLOBAL_BATCH = 4, 8


def torch_collectives(rank, world, round_):
    """torch.distributed (Gloo) all_reduce and all_gather, results checked."""
    x = torch.arange(1000, dtype=torch.float32) * (rank + 1) + round_
    dist.all_reduce(x)
    want = torch.arange(1000, dtype=torch.float32) * sum(range(1, world + 1)) + world * round_
    assert torch.equal(x, want), "torch all_reduce"
    parts = [torch.empty(7) for _ in range(world)]
    dist.all_gather(parts, torch.full((7,), float(rank + round_)))
    assert all(torch.equal(p, torch.full((7,), float(r + round_))) for r, p in enumerate(parts)), "all_gather"


def mapped_files():
    paths = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                paths.add(parts[5].strip())
    return sorted(paths)


def gloo_symbols(path):
    """The Gloo symbols (namespace gloo) the ELF file `path` defines and exports."""
    r = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True)
    if r.returncode != 0:
        return set()
    # Strong definitions only: weak and vague-linkage ones (templates, typeinfo) may repeat.
    return {m.group(1) for m in re.finditer(r" [TDBR] (_ZN(?:K)?4gloo\S*)", r.stdout)}


def main():
    out, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch_collectives(rank, world, 0)

    # Strata's collectives (its gloo backend): the engine all-gathers parameters and
    # reduce-scatters gradients on every step; strata.initialize reuses torch's store.
    model = toy_model.make_model()
    engine, _, _, _ = strata.initialize(model=model, config=toy_model.config(GLOBAL_BATCH, world))
    losses = toy_model.train_slice(engine, rank, world, STEPS, GLOBAL_BATCH)
    params = {k: v.tolist() for k, v in engine.gather_parameters().items()}
    stats = engine.statistics()
    engine.close()

    torch_collectives(rank, world, 1)  # torch's Gloo still works after Strata's traffic
    maps = mapped_files()
    sos = [p for p in maps if ".so" in os.path.basename(p)]
    defined = [p for p in sos if gloo_symbols(p)]
    with open(out, "w") as f:
        json.dump(
            {
                "losses": losses,
                "params": params,
                "comm": stats.get("comm", {}),
                "gloo_files": defined,
                "gloo_named": [p for p in sos if "gloo" in os.path.basename(p).lower()],
                "cudart": [p for p in sos if os.path.basename(p).startswith("libcudart.so")],
                "nccl": [p for p in sos if os.path.basename(p).startswith("libnccl.so")],
                "strata_libs": [p for p in sos if os.path.basename(p).startswith(("libstrata_", "_strata"))],
            },
            f,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
