"""One rank of test_huggingface.py's strata.zero.Init case: each model built
plainly and under strata.zero.Init (values kept, partitioned as built) with the same seed,
trained two steps through strata.initialize; and ("gathered") a change made under
strata.zero.GatheredParameters by the last rank against the same change made before
strata.initialize; the Llama again with its parts kept on the disk (offload_param on
nvme). Prints the losses and parameters of each pair.

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


def run(build, lm, rank, world, cfg, after_init=None):
    model = build()
    engine, *_ = strata.initialize(model=model, config=cfg)
    if after_init is not None:
        after_init(engine, model)
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

    # The parts kept on the disk (the config's offload_param on nvme, as DeepSpeed's Init):
    # the file is unlinked, its bytes are this rank's parts, and the model trains the same.
    parts_dir = os.path.join(os.path.dirname(os.path.abspath(out)), f"parts{rank}")
    os.makedirs(parts_dir, exist_ok=True)
    nvme = json.loads(json.dumps(cfg))
    nvme["zero_optimization"] = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": parts_dir}}

    def on_disk():
        with strata.zero.Init(nvme) as init:
            model = hf_model.make_model(seed=4, dtype=torch.bfloat16)
        assert os.listdir(parts_dir) == [], os.listdir(parts_dir)
        mine = sum(strata.zero.partitioned(p).part.numel() * 2 for p in model.parameters())
        assert init.parts_on_disk == mine > 0, (init.parts_on_disk, mine)
        return model

    result["llama_parts_on_disk"] = {"plain": result["llama"]["plain"], "init": run(on_disk, True, rank, world, cfg)}

    # A change under GatheredParameters by the last rank (the others make another, dropped)
    # against the same change made before strata.initialize.
    def change(model, value):
        with torch.no_grad():
            model.model.layers[0].mlp.up_proj.weight.fill_(value)
            model.model.embed_tokens.weight[:4].mul_(2.0 if value == 0.01 else 5.0)

    def changed_before():
        model = hf_model.make_model(seed=4)
        change(model, 0.01)
        return model

    def change_under(engine, model):
        params = [model.model.layers[0].mlp.up_proj.weight, model.model.embed_tokens.weight]
        with strata.zero.GatheredParameters(params, modifier_rank=world - 1):
            change(model, 0.01 if rank == world - 1 else 0.5)

    fp32 = hf_model.config(hf_model.GLOBAL_BATCH)
    result["gathered"] = {
        "plain": run(changed_before, True, rank, world, fp32),
        "init": run(lambda: hf_model.make_model(seed=4), True, rank, world, fp32, change_under),
    }
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
