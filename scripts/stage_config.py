"""Writes a ZeRO stage-N variant of strata-train's printed config (bench/zero_stages.sh and
tests/examples/strata_train_test.sh): the parameters on the device, the optimizer states in
host memory, a 64 MiB device budget, the batch size left to strata-train (it sets it from
the world size).

usage: stage_config.py IN.json OUT.json STAGE
"""

import json
import sys

src, dst, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(src, encoding="utf-8") as f:
    c = json.load(f)
z = c["zero_optimization"]
z["stage"] = stage
z["offload_optimizer"] = {"device": "cpu"}
z["offload_param"] = {"device": "none"}
c["strata"]["device_budget"] = 64 << 20
c.pop("train_batch_size", None)
with open(dst, "w", encoding="utf-8") as f:
    json.dump(c, f)
