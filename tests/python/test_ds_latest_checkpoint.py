"""DeepSpeed's tests/unit/checkpoint/test_latest_checkpoint.py, ported (its scenarios and
assertions; harness, model and names Strata's), 1 and 2 ranks.

- TestLatestCheckpoint::test_existing_latest: a save without a tag and a load without one
  (the tag ``latest`` names) give the second model the first one's parameters and
  optimizer states (DeepSpeed's checkpoint_correctness_verification compares both; here the
  parameters, and a step after the load equal on both engines for the states).
- TestLatestCheckpoint::test_missing_latest: load_checkpoint of a directory without
  ``latest`` is a no-op returning (None, None) (before this port Strata raised).
"""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_checkpoint_worker.py")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("case", ["existing_latest", "missing_latest"])
def test_latest_checkpoint(tmp_path, case, world):
    port = ranks.free_port()
    results = ranks.run(tmp_path, WORKER, world, args_of=lambda r: [case, tmp_path / "ckpt"],
                        env_of=lambda r: ranks.torchrun_env(r, world, port))
    for rank, r in enumerate(results):
        if case == "missing_latest":
            assert r["loaded"] == [None, None], r
        else:
            assert r["loaded"][0].endswith("global_step2"), r
            assert r["same_parameters"], f"rank {rank}"
            assert r["next_loss"][0] == r["next_loss"][1], f"rank {rank}: {r['next_loss']}"
    assert json.dumps(results[0]["loaded"])  # JSON all the way
