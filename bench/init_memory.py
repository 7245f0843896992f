#!/usr/bin/env python3
"""init_memory: what building a model under strata.zero.Init and strata.initialize cost
each rank's resident set, with glibc's default malloc settings (nothing pinned), against
what the rank must hold: its part of the model plus two blocks while building, and the
engine's own tiers (host and device peaks, from its statistics) plus two blocks through
initialize.

    .venv/bin/python bench/init_memory.py [--ranks 2] [--parts memory|nvme] [--layers 6]
        [--hidden 1024] [--intermediate 4096] [--vocab 32000] [--swap DIR] [--json FILE]

The model is a transformers Llama in fp32 built from its config (random values, nothing
downloaded; the default is the issue's 512 MiB model: 133.5M parameters, 6 blocks of
16.8M), built under ``strata.zero.Init(config)``; ``--parts nvme`` gives the config
``offload_param`` on nvme (the parts kept on the disk), ``memory`` on cpu. Then
``strata.initialize`` with ZeRO-3, the optimizer and the parameters offloaded to the CPU
(with --parts nvme both on NVMe under --swap: the ZeRO-Infinity section), and one step of 1 x 32
tokens per rank. Each rank runs in its own process (torchrun's environment, gloo), one
thread each. Printed per rank: the resident set after the imports, the peak growth while
building (VmHWM, from the imports' resident set) against the part plus two blocks (a
block: the largest module, a decoder layer or the embedding), and
the peak growth through initialize (VmHWM reset after building) against the engine's
tiers' peaks plus two blocks.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

from default_sizes import status as status_bytes  # /proc/self/status's value in bytes (bench/)


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from the resident set


def ds_config(a):
    tier = {"device": "nvme", "nvme_path": a.swap} if a.parts == "nvme" else {"device": "cpu"}
    return {"train_batch_size": a.ranks, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_optimizer": dict(tier), "offload_param": dict(tier)}}


def worker(a):
    import torch

    torch.set_num_threads(1)
    import strata
    from transformers import LlamaConfig, LlamaForCausalLM

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=16, num_key_value_heads=16,
                      max_position_embeddings=256, tie_word_embeddings=True)
    ds = ds_config(a)
    out = {"rank": rank}
    reset_peak()
    out["imports_rss"] = status_bytes("VmRSS")
    with strata.zero.Init(ds):
        model = LlamaForCausalLM(cfg)
    out["built_peak_growth"] = status_bytes("VmHWM") - out["imports_rss"]
    out["built_rss_growth"] = status_bytes("VmRSS") - out["imports_rss"]
    parts = [strata.zero.partitioned(p) for p in model.parameters()]
    out["params"] = sum(p.numel for p in parts)
    out["part_bytes"] = sum(p.part.numel() * p.part.element_size() for p in parts)
    # A block: the largest module (a decoder layer, or the embedding where it is larger).
    out["block_bytes"] = max(block_elements(cfg), cfg.vocab_size * cfg.hidden_size) * 4
    rss_built = status_bytes("VmRSS")
    reset_peak()
    engine, *_ = strata.initialize(model=model, config=ds)
    stats = engine.statistics()
    out["initialize_peak_growth"] = status_bytes("VmHWM") - rss_built
    out["initialize_rss_growth"] = status_bytes("VmRSS") - rss_built
    out["engine_tiers_peak"] = stats["host"]["peak_bytes"] + stats["device"]["peak_bytes"]
    ids = torch.randint(0, a.vocab, (1, 32), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    out["loss"] = float(loss.detach())
    engine.close()
    print("RESULT " + json.dumps(out), flush=True)


def block_elements(cfg):
    """One decoder layer's parameters (attention, MLP, two norms), from the config."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = h * cfg.num_key_value_heads // cfg.num_attention_heads
    return 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--parts", choices=["memory", "nvme"], default="memory")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--swap", default="/var/tmp/strata_init_memory")
    ap.add_argument("--json", default="")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    os.makedirs(a.swap, exist_ok=True)
    port = free_port()
    procs = []
    for r in range(a.ranks):
        env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(a.ranks),
               "LOCAL_WORLD_SIZE": str(a.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", *sys.argv[1:]],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    t0, results, failed = time.time(), [], False
    for r, p in enumerate(procs):
        text, _ = p.communicate(timeout=3600)
        lines = [l for l in text.splitlines() if l.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            failed = True
            print(f"rank {r} failed (exit {p.returncode}):\n" + "\n".join(text.splitlines()[-20:]))
            continue
        results.append(json.loads(lines[-1][len("RESULT "):]))
    mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
    for o in results:
        bound_built = o["part_bytes"] + 2 * o["block_bytes"]
        bound_init = o["engine_tiers_peak"] + 2 * o["block_bytes"]
        print(f"rank {o['rank']}: {o['params'] / 1e6:.1f}M parameters, part {mib(o['part_bytes'])}, block "
              f"{mib(o['block_bytes'])}, after the imports {mib(o['imports_rss'])}; building: peak +"
              f"{mib(o['built_peak_growth'])} (part + two blocks {mib(bound_built)}), then +"
              f"{mib(o['built_rss_growth'])}; initialize: peak +{mib(o['initialize_peak_growth'])} (the engine's "
              f"tiers' peaks + two blocks {mib(bound_init)}), then +{mib(o['initialize_rss_growth'])}; "
              f"loss {o['loss']:.4f}")
    summary = {"ranks": a.ranks, "parts": a.parts, "seconds": round(time.time() - t0, 1), "results": results}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
