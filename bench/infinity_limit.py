"""DeepSpeed's ZeRO-Infinity section, as its docs give it (no sizing key), under a memory limit.

One rank builds a transformers Llama in bf16 under strata.zero.Init (random values, nothing
downloaded), calls strata.initialize with

    {"zero_optimization": {"stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": SWAP, "pin_memory": true},
        "offload_param": {"device": "nvme", "nvme_path": SWAP, "pin_memory": true}},
     "bf16": {"enabled": true}, ...}

and trains S steps of one sequence. With --limit-gib and root, the worker runs in a memory
cgroup of that limit made for the run (cgroup v2 memory.max, or v1 memory.limit_in_bytes),
removed afterwards; without root it refuses (a limit it cannot set would measure nothing).
Printed: each phase's resident set and VmHWM, the engine's sizing lines, how the worker
ended (its exit code: 137 is the kernel's kill) and the cgroup's peak.

    .venv/bin/python bench/infinity_limit.py [--limit-gib 6] [--steps 2] [--swap DIR]
        [--hidden 2048 --layers 16 --intermediate 8192 --vocab 128256]

The default model is 1,235,814,400 parameters (fp32 states 14.9 GB on SWAP). Needs the built
package on PYTHONPATH (build/python) and transformers in the venv.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def status_mib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) >> 10
    raise KeyError(key)


def worker(a):
    import torch
    import strata
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=512, tie_word_embeddings=True)
    ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3,
                                "offload_optimizer": {"device": "nvme", "nvme_path": a.swap, "pin_memory": True},
                                "offload_param": {"device": "nvme", "nvme_path": a.swap, "pin_memory": True}}}
    t0 = time.time()

    def phase(name, **extra):
        print(json.dumps({"phase": name, "s": round(time.time() - t0, 1), "rss_mib": status_mib("VmRSS"),
                          "hwm_mib": status_mib("VmHWM"), **extra}), flush=True)

    torch.set_default_dtype(torch.bfloat16)
    with strata.zero.Init(ds):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    phase("built", params=sum(strata.zero.partitioned(p).numel for p in model.parameters()))
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(), config=ds)
    phase("initialized")
    g = torch.Generator().manual_seed(0)
    for step in range(a.steps):
        ids = torch.randint(0, a.vocab, (1, a.seq), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        phase("step", step=step, loss=float(loss.detach()))


def make_cgroup(limit):
    """A memory cgroup of `limit` bytes: (its directory, the file that reports its peak)."""
    name = f"strata_infinity_{os.getpid()}"
    v2 = "/sys/fs/cgroup/cgroup.controllers"
    if os.path.exists(v2) and "memory" in open(v2).read().split():
        d = os.path.join("/sys/fs/cgroup", name)
        os.mkdir(d)
        with open(os.path.join(d, "memory.max"), "w") as f:
            f.write(str(limit))
        return d, "memory.peak"
    d = os.path.join("/sys/fs/cgroup/memory", name)
    os.mkdir(d)
    with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    return d, "memory.max_usage_in_bytes"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-gib", type=float, default=0.0, help="0: no limit")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--swap", default="/var/tmp/strata_infinity_swap")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    os.makedirs(a.swap, exist_ok=True)
    args = [sys.executable, os.path.abspath(__file__), "--worker"] + sys.argv[1:]
    cgroup, peak_file = None, None
    if a.limit_gib > 0:
        if os.geteuid() != 0:
            sys.exit("infinity_limit: --limit-gib needs root to make a memory cgroup")
        cgroup, peak_file = make_cgroup(int(a.limit_gib * (1 << 30)))
        procs = os.path.join(cgroup, "cgroup.procs")
        proc = subprocess.Popen(args, preexec_fn=lambda: open(procs, "w").write(str(os.getpid())))
    else:
        proc = subprocess.Popen(args)
    rc = proc.wait()
    out = {"limit_gib": a.limit_gib, "exit_code": rc, "killed": rc in (-9, 137)}
    if cgroup:
        try:
            out["cgroup_peak_mib"] = int(open(os.path.join(cgroup, peak_file)).read()) >> 20
        except OSError:
            pass
        os.rmdir(cgroup)
    shutil.rmtree(a.swap, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
