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
With --room-mib R instead, the cgroup's limit is set once the model is built, to what the
cgroup uses then plus R: the memory initialize and the steps are given, the same on any
machine whatever the interpreter and its libraries were charged.
Printed: each phase's resident set and VmHWM (reset after initialize: a step's line shows the steps' own peak), the engine's sizing lines, how the worker
ended (its exit code: 137 is the kernel's kill) and the cgroup's peak.

    .venv/bin/python bench/infinity_limit.py [--limit-gib 6 | --room-mib 2048] [--steps 2] [--swap DIR]
        [--hidden 2048 --layers 16 --intermediate 8192 --vocab 128256] [--zero '{"sub_group_size": 1e6}']

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
    for key, value in json.loads(a.zero).items():  # --zero: keys set on top, as a user would
        section = ds["zero_optimization"]
        if key.startswith("strata."):  # strata.pipeline_step ...: the strata section's
            section, key = ds.setdefault("strata", {}), key[len("strata."):]
        *path, last = key.split(".")
        for k in path:
            section = section[k]
        section[last] = value
    t0 = time.time()

    def phase(name, **extra):
        print(json.dumps({"phase": name, "s": round(time.time() - t0, 1), "rss_mib": status_mib("VmRSS"),
                          "hwm_mib": status_mib("VmHWM"), **extra}), flush=True)

    torch.set_default_dtype(torch.bfloat16)
    with strata.zero.Init(ds):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    phase("built", params=sum(strata.zero.partitioned(p).numel for p in model.parameters()))
    if a.room_mib > 0:
        d, usage, limit_file = os.environ["STRATA_BENCH_CGROUP"].split(os.pathsep)
        used = int(open(os.path.join(d, usage)).read())
        with open(os.path.join(d, limit_file), "w") as f:
            f.write(str(used + (a.room_mib << 20)))
        phase("limited", cgroup_used_mib=used >> 20, limit_mib=(used >> 20) + a.room_mib)
    engine, *_ = strata.initialize(model=model, model_parameters=model.parameters(), config=ds)
    phase("initialized")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again: the steps' lines show the steps' own peak
    g = torch.Generator().manual_seed(0)
    for step in range(a.steps):
        ids = torch.randint(0, a.vocab, (1, a.seq), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        phase("step", step=step, loss=float(loss.detach()))


def make_cgroup(limit):
    """A memory cgroup of `limit` bytes (0: none yet): (its directory, the files that report
    its peak, its use and set its limit)."""
    name = f"strata_infinity_{os.getpid()}"
    v2 = "/sys/fs/cgroup/cgroup.controllers"
    if os.path.exists(v2) and "memory" in open(v2).read().split():
        d, files = os.path.join("/sys/fs/cgroup", name), ("memory.peak", "memory.current", "memory.max")
    else:
        d = os.path.join("/sys/fs/cgroup/memory", name)
        files = ("memory.max_usage_in_bytes", "memory.usage_in_bytes", "memory.limit_in_bytes")
    os.mkdir(d)
    if limit > 0:
        with open(os.path.join(d, files[2]), "w") as f:
            f.write(str(limit))
    return d, files


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-gib", type=float, default=0.0, help="0: no limit")
    ap.add_argument("--room-mib", type=int, default=0,
                    help="instead: the limit set once the model is built, its use then plus this")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--swap", default="/var/tmp/strata_infinity_swap")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--zero", default="{}",
                    help='zero_optimization keys to set, JSON: {"sub_group_size": 1e6, "offload_param.max_in_cpu": 0}; "strata.KEY": the strata section\'s')
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    os.makedirs(a.swap, exist_ok=True)
    args = [sys.executable, os.path.abspath(__file__), "--worker"] + sys.argv[1:]
    cgroup, files = None, None
    if a.limit_gib > 0 or a.room_mib > 0:
        if os.geteuid() != 0:
            sys.exit("infinity_limit: --limit-gib and --room-mib need root to make a memory cgroup")
        cgroup, files = make_cgroup(int(a.limit_gib * (1 << 30)))
        procs = os.path.join(cgroup, "cgroup.procs")
        env = dict(os.environ, STRATA_BENCH_CGROUP=os.pathsep.join((cgroup, files[1], files[2])))
        proc = subprocess.Popen(args, env=env, preexec_fn=lambda: open(procs, "w").write(str(os.getpid())))
    else:
        proc = subprocess.Popen(args)
    rc = proc.wait()
    out = {"limit_gib": a.limit_gib, "room_mib": a.room_mib, "exit_code": rc, "killed": rc in (-9, 137)}
    if cgroup:
        try:
            out["cgroup_peak_mib"] = int(open(os.path.join(cgroup, files[0])).read()) >> 20
        except OSError:
            pass
        os.rmdir(cgroup)
    shutil.rmtree(a.swap, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
