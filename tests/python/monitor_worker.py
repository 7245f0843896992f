"""One rank of test_monitor.py's two-rank run: trains TokenModel three steps with the
csv_monitor writing to argv[2] (each rank its own output_path, so a file written by rank 1
would show) and records the global mean loss and lr of each step."""

import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import strata  # noqa: E402
from test_monitor import BATCH, TokenModel, config, train  # noqa: E402


def main():
    out, where = sys.argv[1], pathlib.Path(sys.argv[2])
    rank = int(__import__("os").environ["RANK"])
    cfg = config(where, 1, csv_monitor={"enabled": True, "output_path": str(where / f"rank{rank}"),
                                        "job_name": "j"})
    engine, *_ = strata.initialize(model=TokenModel(), config=cfg)
    steps = []
    g = torch.Generator().manual_seed(7)
    for _ in range(3):
        # Every rank its own half of the global batch; the monitor records rank 0's loss.
        ids = torch.randint(0, 32, (2, BATCH // 2, 8), generator=g)[rank]
        loss = engine(ids)
        engine.backward(loss)
        r = engine.step()
        steps.append((loss.item(), r["lr"]))
    world = engine.world_size
    engine.close()
    json.dump({"rank": rank, "world": world, "steps": steps}, open(out, "w"))


if __name__ == "__main__":
    main()
