"""One rank of test_trainer.py's two-rank run (started by torchrun): StrataTrainer on gloo,
each rank half of every micro-batch; prints LOSSES <json>, the per-step losses averaged
over the ranks, from rank 0."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from strata.integrations.transformers import StrataTrainer  # noqa: E402

import hf_model  # noqa: E402
import trainer_common as tc  # noqa: E402

trainer = tc.recording(StrataTrainer)(
    model=hf_model.make_model(0), args=tc.arguments(sys.argv[1], world=2), train_dataset=tc.Rows()
)
trainer.train()
losses = torch.tensor(tc.step_losses(trainer.micro_losses), dtype=torch.float64)
dist.all_reduce(losses)
losses /= dist.get_world_size()
assert trainer.engine.world_size == 2, trainer.engine.world_size
if dist.get_rank() == 0:
    print("LOSSES " + json.dumps(losses.tolist()), flush=True)
trainer.engine.close()
