"""One rank of test_huggingface.py's strata.zero.Init case (issue #59): each model built
plainly and under strata.zero.Init (values kept, partitioned as built) with the same seed,
trained two steps through strata.initialize; prints the losses and parameters of both.

usage: zero_init_worker.py OUT.json   (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set, or none)
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_model  # noqa: E402
import strata  # noqa: E402
import transformers  # noqa: E402, F401  (imported before the context: its initialization is followed)


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc = torch.nn.Linear(dim, 2 * dim)
        self.out = torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(x)))


class ScaledLinear(torch.nn.Linear):
    """A subclass that sets values after super().__init__() (partitioned after it, not before)."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        with torch.no_grad():
            self.weight.mul_(0.5)
            self.bias.fill_(0.125)


class Gpt(torch.nn.Module):
    """nanoGPT's pattern: the children built, then self.apply(init) over all of them, then a
    scaled re-initialization of some weights by name."""

    def __init__(self, vocab=hf_model.VOCAB, dim=32):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList([Block(dim) for _ in range(2)])
        self.head = ScaledLinear(dim, vocab)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("out.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / 2)

    @staticmethod
    def _init_weights(m):
        if isinstance(m, torch.nn.Linear) and not isinstance(m, ScaledLinear):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)
            torch.nn.init.zeros_(m.bias)
        elif isinstance(m, torch.nn.Embedding):
            torch.nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def run(build, lm, rank, world, cfg):
    model = build()
    engine, *_ = strata.initialize(model=model, config=cfg)
    micro = hf_model.GLOBAL_BATCH // world
    losses = []
    for ids in hf_model.batches(2, hf_model.GLOBAL_BATCH):
        mine = ids[rank * micro : (rank + 1) * micro]
        if lm:
            loss = engine(input_ids=mine, labels=mine).loss
        else:
            logits = engine(mine)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, hf_model.VOCAB), mine.reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {k: v.tolist() for k, v in engine.gather_parameters().items()}
    engine.close()
    return {"losses": losses, "params": params}


def main():
    out = sys.argv[1]
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cfg = hf_model.config(hf_model.GLOBAL_BATCH)
    cfg["bf16"] = {"enabled": True}
    result = {}
    for name, lm, build in (
        ("llama", True, lambda: hf_model.make_model(seed=4, dtype=torch.bfloat16)),
        ("gpt", False, lambda: (torch.manual_seed(4), Gpt())[1]),
    ):
        plain = run(build, lm, rank, world, cfg)

        def partitioned():
            with strata.zero.Init(cfg):
                model = build()
            sizes = {p.numel() for p in model.parameters()}
            assert sizes == {0}, f"{name}: not partitioned while built: {sizes}"
            return model

        under = run(partitioned, lm, rank, world, cfg)
        result[name] = {"plain": plain, "init": under}
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
