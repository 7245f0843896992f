"""The README's Python quick start, run by tests/python/test_examples.py so that it stays
true: a residual MLP trained with ZeRO-3 and the optimizer offloaded to the host tier.

    PYTHONPATH=build/python .venv/bin/python examples/python/quickstart.py
    PYTHONPATH=build/python .venv/bin/torchrun --nproc_per_node 2 examples/python/quickstart.py

Exit status 0 when the loss (mean of the last 10 steps) fell below half of the first.
"""

import sys

import torch

import strata


# [quickstart]
class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


torch.manual_seed(0)
model = torch.nn.Sequential(*[Block(32) for _ in range(4)], torch.nn.Linear(32, 1))
config = {
    "train_micro_batch_size_per_gpu": 16,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                          "stage3_param_persistence_threshold": 0},
}
engine, optimizer, _, scheduler = strata.initialize(model=model, config=config)  # torchrun's ranks, if any

w = torch.randn(32, 1) / 32**0.5  # the target function
torch.manual_seed(1 + engine.rank)  # each rank draws its own batches
losses = []
for step in range(60):
    x = torch.randn(16, 32)
    loss = torch.nn.functional.mse_loss(engine(x), torch.tanh(x @ w))
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
# [quickstart]

last = sum(losses[-10:]) / 10
if engine.rank == 0:
    stats = engine.statistics()
    print(f"quickstart.py: {engine.world_size} rank(s), {len(losses)} steps, loss {losses[0]:.4f} -> {last:.4f}, "
          f"{stats['optimizer']['steps_applied']} optimizer steps")
engine.close()
sys.exit(0 if last < 0.5 * losses[0] else 1)
