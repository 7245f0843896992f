"""A small GPT-like torch.nn model and its data, shared by the engine tests and the rank
worker (engine_worker.py)."""

import torch

VOCAB, DIM, SEQ = 50, 16, 12


class Net(torch.nn.Module):
    """Embedding, two residual blocks of layer norm + linear + gelu + linear, final norm
    and an untied head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(
            [
                torch.nn.Sequential(
                    torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 2 * DIM), torch.nn.GELU(), torch.nn.Linear(2 * DIM, DIM)
                )
                for _ in range(2)
            ]
        )
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(self.norm(h))


def make_model(seed=0):
    torch.manual_seed(seed)
    return Net()


def batches(steps, batch, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        yield x.to(device), y.to(device)


def loss_fn(logits, y):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def config(global_batch, world_size, lr=1e-2):
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": global_batch // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }


def reference_losses(steps, global_batch, lr=1e-2, device="cpu", optimizer=None):
    """The same model trained with torch.optim.Adam (or optimizer(model)) on the whole batch
    in one process."""
    model = make_model().to(device)
    opt = optimizer(model) if optimizer else torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in batches(steps, global_batch, device=device):
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


def train_slice(engine, rank, world, steps, global_batch):
    """Trains `engine` on rank's slice of every global batch; returns this rank's losses."""
    micro = global_batch // world
    losses = []
    for x, y in batches(steps, global_batch):
        xs, ys = x[rank * micro : (rank + 1) * micro], y[rank * micro : (rank + 1) * micro]
        loss = loss_fn(engine(xs), ys)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# The fine-tuning recipe: weight decay on matrices only (none on biases and norms), and the
# no-decay group at twice the learning rate (so that a group's lr is exercised too).
RECIPE_LR, RECIPE_DECAY = 1e-2, 0.1


def recipe_groups(model):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": RECIPE_DECAY},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2 * RECIPE_LR},
    ]


def recipe_config(global_batch, world_size):
    cfg = config(global_batch, world_size, lr=RECIPE_LR)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": RECIPE_LR, "weight_decay": 0.01}}
    return cfg


def recipe_reference(steps, global_batch):
    """The same model and groups under torch.optim.AdamW, one process, whole batch."""
    return reference_losses(
        steps, global_batch, optimizer=lambda m: torch.optim.AdamW(recipe_groups(m), lr=RECIPE_LR)
    )


# LAMB: DeepSpeed's Lamb type with the recipe's groups, and a clamp [min, max] that the
# toy model's trust ratios reach at both ends.
LAMB_MIN_COEFF, LAMB_MAX_COEFF = 0.5, 2.0


def lamb_config(global_batch, world_size):
    cfg = config(global_batch, world_size, lr=RECIPE_LR)
    cfg["optimizer"] = {
        "type": "Lamb",
        "params": {"lr": RECIPE_LR, "weight_decay": 0.01, "min_coeff": LAMB_MIN_COEFF, "max_coeff": LAMB_MAX_COEFF},
    }
    return cfg


class Float64Lamb(torch.optim.Optimizer):
    """The published LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning",
    Algorithm 2: Adam's bias-corrected moments, update u = m_hat / (sqrt(v_hat) + eps) +
    weight_decay * w, step lr * ||w|| / ||u|| * u, ratio 1 when a norm is 0), in float64,
    with DeepSpeed's clamp of the ratio to [min_coeff, max_coeff]. The reference Strata's
    Lamb is tested against; ``ratios`` keeps every ratio taken."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 min_coeff=0.01, max_coeff=10.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      min_coeff=min_coeff, max_coeff=max_coeff))
        self.ratios = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                st = self.state[p]
                if not st:
                    st["t"] = 0
                    st["w"] = p.detach().double().clone()
                    st["m"] = torch.zeros_like(st["w"])
                    st["v"] = torch.zeros_like(st["w"])
                st["t"] += 1
                t, w, m, v = st["t"], st["w"], st["m"], st["v"]
                g = p.grad.double()
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + group["eps"]) + group["weight_decay"] * w
                wn, un = w.norm().item(), u.norm().item()
                ratio = min(max(wn / un, group["min_coeff"]), group["max_coeff"]) if wn > 0 and un > 0 else 1.0
                self.ratios.append(ratio)
                w.sub_(group["lr"] * ratio * u)
                p.copy_(w)


def lamb_reference(steps, global_batch, device="cpu"):
    """The toy model under Float64Lamb with the recipe's groups; returns (losses, model,
    optimizer)."""
    made = []

    def make(m):
        made.append(Float64Lamb(recipe_groups(m), lr=RECIPE_LR, weight_decay=0.01,
                                min_coeff=LAMB_MIN_COEFF, max_coeff=LAMB_MAX_COEFF))
        return made[-1]

    losses, model = reference_losses(steps, global_batch, device=device, optimizer=make)
    return losses, model, made[0]
