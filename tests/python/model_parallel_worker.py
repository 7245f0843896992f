"""One rank of test_model_parallel.py: 2-way tensor x 2-way data parallel on 4 ranks.

The test's own column- and row-parallel MLP layers run over a tensor-parallel
torch.distributed group; strata.initialize(..., mpu=...) partitions each rank's shard over
its data-parallel group. The same model is trained whole by torch.optim.AdamW in this
process as the reference.

usage: model_parallel_worker.py OUT.json RANK PORT MODE
  MODE train: train and compare; ckpt DIR: save a checkpoint midway, train on, load it
  and train the rest again; clip: gradient_clipping with the mpu must be refused
"""

import json
import os
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402

DIM, HIDDEN, ROWS, BLOCKS, STEPS, TP, DP = 8, 32, 8, 2, 6, 2, 2

out_path, rank, port, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP * DP)
tp_rank, dp_rank = rank % TP, rank // TP
# Every rank makes every group, in the same order.
tp_groups = [dist.new_group([d * TP + t for t in range(TP)]) for d in range(DP)]
dp_groups = [dist.new_group([d * TP + t for d in range(DP)]) for t in range(TP)]
TP_GROUP, DP_GROUP = tp_groups[dp_rank], dp_groups[tp_rank]


class Mpu:
    """DeepSpeed's mpu interface, as Megatron-style code hands it to the engine."""

    def get_model_parallel_rank(self):
        return tp_rank

    def get_model_parallel_world_size(self):
        return TP

    def get_model_parallel_group(self):
        return TP_GROUP

    def get_data_parallel_rank(self):
        return dp_rank

    def get_data_parallel_world_size(self):
        return DP

    def get_data_parallel_group(self):
        return DP_GROUP


class CopyToTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=TP_GROUP)
        return g


class ReduceFromTp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=TP_GROUP)
        return x

    @staticmethod
    def backward(ctx, g):
        return g


class Block(torch.nn.Module):
    """x + W2 gelu(W1 x + b1) + b2; tp None: whole, else that rank's shard (W1's and b1's
    rows, W2's columns; b2 replicated)."""

    def __init__(self, tp):
        super().__init__()
        h = HIDDEN if tp is None else HIDDEN // TP
        self.tp = tp
        self.w1 = torch.nn.Parameter(torch.empty(h, DIM))
        self.b1 = torch.nn.Parameter(torch.empty(h))
        self.w2 = torch.nn.Parameter(torch.empty(DIM, h))
        self.b2 = torch.nn.Parameter(torch.empty(DIM))

    def forward(self, x):
        inp = x if self.tp is None else CopyToTp.apply(x)
        partial = torch.nn.functional.gelu(inp @ self.w1.t() + self.b1) @ self.w2.t()
        y = partial if self.tp is None else ReduceFromTp.apply(partial)
        return x + y + self.b2


class Net(torch.nn.Module):
    def __init__(self, tp):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(tp) for _ in range(BLOCKS))
        self.head = torch.nn.Linear(DIM, DIM)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def whole_init():
    g = torch.Generator().manual_seed(21)
    v = {}
    for i in range(BLOCKS):
        v[f"blocks.{i}.w1"] = torch.randn(HIDDEN, DIM, generator=g) * 0.3
        v[f"blocks.{i}.b1"] = torch.randn(HIDDEN, generator=g) * 0.1
        v[f"blocks.{i}.w2"] = torch.randn(DIM, HIDDEN, generator=g) * 0.2
        v[f"blocks.{i}.b2"] = torch.randn(DIM, generator=g) * 0.1
    v["head.weight"] = torch.randn(DIM, DIM, generator=g) * 0.3
    v["head.bias"] = torch.randn(DIM, generator=g) * 0.1
    return v


def shard(name, whole, tp):
    h = HIDDEN // TP
    if name.endswith(".w1") or name.endswith(".b1"):
        return whole[tp * h : (tp + 1) * h]
    if name.endswith(".w2"):
        return whole[:, tp * h : (tp + 1) * h]
    return whole


def make(tp):
    net = Net(tp)
    init = whole_init()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(init[name] if tp is None else shard(name, init[name], tp))
    return net


def batch(step):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(ROWS, DIM, generator=g), torch.randn(ROWS, DIM, generator=g)


# The reference: the whole model, the global batch, torch.optim.AdamW.
ref = make(None)
opt = torch.optim.AdamW(ref.parameters(), lr=0.01, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
ref_losses = []
for step in range(STEPS):
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(ref(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    ref_losses.append(loss.item())

config = {
    "train_batch_size": ROWS,
    "train_micro_batch_size_per_gpu": ROWS // DP,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 0},
}
net = make(tp_rank)
if mode == "clip":
    try:
        strata.initialize(model=net, config=dict(config, gradient_clipping=1.0), mpu=Mpu(), blocks=list(net.blocks))
        error = None
    except NotImplementedError as e:
        error = str(e)
    with open(out_path, "w") as f:
        json.dump({"error": error}, f)
    dist.destroy_process_group()
    sys.exit(0)
engine, _, _, _ = strata.initialize(model=net, config=config, mpu=Mpu(), blocks=list(net.blocks))
rows = ROWS // DP


def train(steps):
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(engine(x[dp_rank * rows : (dp_rank + 1) * rows]), y[dp_rank * rows : (dp_rank + 1) * rows])
        t = loss.detach().clone()
        dist.all_reduce(t, group=DP_GROUP)
        losses.append(t.item() / DP)
        engine.backward(loss)
        engine.step()
    return losses


result = {"rank": rank, "tp": tp_rank, "dp": dp_rank, "engine_rank": engine.rank, "engine_world": engine.world_size,
          "global_rank": engine.global_rank}
if mode == "ckpt":
    ckpt = sys.argv[5]
    first = train(range(3))
    engine.save_checkpoint(ckpt, tag="half")
    train(range(3, STEPS))
    engine.load_checkpoint(ckpt, tag="half")
    losses = first + train(range(3, STEPS))
else:
    losses = train(range(STEPS))
result["losses"], result["ref_losses"] = losses, ref_losses
trained = dict(ref.named_parameters())
diffs = {}
for name, p in engine.gather_parameters().items():
    want = shard(name, trained[name].detach(), tp_rank)
    diffs[name] = ((p - want).norm() / want.norm()).item()
result["param_rel_diff"] = diffs
with open(out_path, "w") as f:
    json.dump(result, f)
dist.destroy_process_group()
