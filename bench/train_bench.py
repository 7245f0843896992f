#!/usr/bin/env python3
"""train_bench: a GPT-style model trained by Strata, beside plain PyTorch (and FSDP2 with
CPU offload where it runs), in the same run.

    python bench/train_bench.py [--device cuda|cpu] [--model tiny|small|1.3b|2.7b|5b]
        [--layers 24 --dim 2048 --heads 16 --vocab 32000 --seq 1024] [--batch 8]
        [--accumulation K] [--steps 6 --warmup 2] [--dtype bf16|fp16|fp32]
        [--offload-param] [--device-budget BYTES] [--peers strata,strata-early,torch,fsdp2]
        [--strata-set KEY=JSON ...] [--rounds N] [--trace FILE] [--json FILE]

Each peer trains the same model (pre-norm blocks of causal self-attention through
scaled_dot_product_attention and a 4x GELU MLP, tied embedding/head; the project's own
code) from the same initial values on the same random tokens:

- strata:  strata.initialize with the optimizer (and, with --offload-param, the
           parameters) offloaded to the host, CPU-Adam; working precision --dtype.
- strata-early: the same with the early step (strata.early_step true, skip_inf_nan_steps
           false: each group's update starts in the backward once its gradient is final),
           so both of Strata's steps are measured in one run on the same machine.
- strata:KEY=JSON[+KEY=JSON...]: the strata peer with these strata.* keys set too (after
           --strata-set), e.g. strata:accumulate_in_background=false, to compare a key's
           settings in one run. A KEY with a dot is a path from the config's root, e.g.
           strata:zero_optimization.reduce_bucket_size=1 (a bucket per block: a bucket
           holds at least the largest group).
- torch:   the model on the device, fp32 parameters under autocast(--dtype), AdamW
           (fused on CUDA): the "where it fits" baseline.
- fsdp2:   torch.distributed.fsdp.fully_shard with CPUOffloadPolicy and
           MixedPrecisionPolicy(--dtype) on one rank (CUDA only).
- deepspeed: DeepSpeed ZeRO-3 with the optimizer (and with --offload-param the
           parameters) offloaded, when its package is importable (bench/peers/install.sh
           brings it); reported as not installed otherwise. Ran on the CPU, one rank
           (docs/PERFORMANCE.md); on the CPU at 1 and 2 ranks beside FSDP2, with each
           peer in its own processes, see bench/peers/train_peers.py.

--model picks a preset (default 1.3b; see PRESETS: up to 5b, the largest GPT whose host
state fits a 128 GiB GPU machine with the optimizer on the host); --layers and the rest
override its values. --accumulation K makes each step K micro-steps of --batch sequences
and one optimizer step (gradient_accumulation_steps K for Strata and DeepSpeed, whose
step() is called after every backward; torch and FSDP2 scale the loss by 1/K and step
once), so step time, tokens/s and TFLOPS are per optimizer step of K x batch x seq tokens.

Reported per peer: median step time over the timed steps, tokens/s, model TFLOPS
(6 x parameters x tokens plus attention 12 x layers x seq x dim per token, full causal
square counted; no recompute: core/throughput.h through strata.training_flops_per_token,
the definition strata-train uses) and MFU against --peak-tflops, else the GPU's datasheet
peak for --dtype (strata.datasheet_peak_flops), else this CPU's GEMM peak measured at
start in --dtype (bench/gemm_peak.py, about a second), the phases (forward, backward, step; each ends with a
device synchronize for the measurement: the only synchronizes in the loop), the device
memory peak (torch's allocator, plus Strata's arena for strata), the host peak (this
process's resident high-water mark, which only grows, so peers after the first report at
least the earlier peak; and Strata's host tier) and, for strata, the exposed (waited)
time of each kind of wait from engine.statistics() (with "step_updates", the next
forward's waits for the pipelined step's updates) and how long the pipelined update ran.
A peer that fails reports its error; the others still run.

--strata-set KEY=JSON sets a strata.* key (a dotted KEY: a path from the config's root) for
every strata peer (e.g. early_step=true with skip_inf_nan_steps=false); --trace FILE writes the strata peer's timeline of every step
(warm-up included) as Chrome/Perfetto trace JSON (engine.write_trace); the strata-early
peer's goes to FILE's stem plus "-early", a strata:KEY=JSON peer's to the stem plus its
keys (the last round's). --rounds N runs the peers N times in turn (peer 1, peer 2, ...,
peer 1, ...), so that a noisy machine's drift falls on every peer alike, and ends with each
peer's median step time over the rounds.
"""

import argparse
import importlib.util
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab, dim, layers, heads, seq):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.zeros(seq, dim))
        self.blocks = torch.nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, tokens):
        h = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            h = b(h)
        return self.norm(h) @ self.emb.weight.t()


def make_model(args):
    torch.manual_seed(1234)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    for n, p in model.named_parameters():
        if p.dim() >= 2:
            torch.nn.init.normal_(p, std=0.02)
    return model


def batches(args, device):
    """Per optimizer step (warm-up included), its --accumulation micro-batches."""
    g = torch.Generator().manual_seed(99)
    for _ in range(args.warmup + args.steps):
        step = []
        for _ in range(args.accumulation):
            t = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
            step.append((t[:, :-1].to(device), t[:, 1:].to(device)))
        yield step


def loss_of(logits, y):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def model_flops_per_token(params, args):
    """The project's one definition (core/throughput.h, as strata-train reports it)."""
    import strata

    return strata.training_flops_per_token(params, args.layers, args.seq, args.dim)


def peak_flops(args, device):
    """(FLOP/s of one device, where the figure comes from): --peak-tflops, else a GPU's
    datasheet peak for --dtype, else this CPU's GEMM peak in --dtype measured here
    (bench/gemm_peak.py; a CPU with AVX-512-BF16 runs bf16 GEMMs about 4x faster than fp32,
    so an fp32 peak would put a bf16 run's MFU above 100%)."""
    import strata

    if args.peak_tflops > 0:
        return args.peak_tflops * 1e12, "--peak-tflops"
    if device.type == "cuda":
        sheet = strata.datasheet_peak_flops(torch.cuda.get_device_name(device), args.dtype)
        return (sheet[0], sheet[1]) if sheet else (0.0, "no datasheet entry for this GPU")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gemm_peak import measure_peak

    r = measure_peak("cpu", args.dtype, sizes=(256, 512, 1024), seconds=0.3)
    return r["tflops"] * 1e12, (f"measured {args.dtype} GEMM peak (n = {r['n']}, "
                                f"{torch.get_num_threads()} threads)")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_loop(args, device, forward, backward, step, step_every_micro_step=False):
    """Runs warmup + timed optimizer steps of --accumulation micro-steps each; returns
    per-phase lists for the timed steps (forward and backward summed over the micro-steps,
    step: the optimizer's call(s)) and every micro-step's loss. `step_every_micro_step`: the
    peer's step() is called after every backward and applies the optimizer at the boundary
    (Strata's and DeepSpeed's API; its non-boundary calls count as step time); otherwise
    once, after the last."""
    phases = {"forward": [], "backward": [], "step": [], "total": []}
    losses = []
    for i, micro in enumerate(batches(args, device)):
        fwd = bwd = opt = 0.0
        t_start = time.perf_counter()
        for k, (x, y) in enumerate(micro):
            t0 = time.perf_counter()
            loss = forward(x, y)
            sync(device)
            t1 = time.perf_counter()
            backward(loss)
            sync(device)
            t2 = time.perf_counter()
            if step_every_micro_step or k == len(micro) - 1:
                step()
                sync(device)
            t3 = time.perf_counter()
            fwd, bwd, opt = fwd + t1 - t0, bwd + t2 - t1, opt + t3 - t2
            losses.append(loss.item())
        if i >= args.warmup:
            phases["forward"].append(fwd)
            phases["backward"].append(bwd)
            phases["step"].append(opt)
            phases["total"].append(time.perf_counter() - t_start)
    return phases, losses


def summarize(name, args, device, params, phases, losses, extra):
    import strata

    step_s = statistics.median(phases["total"])
    tokens = args.batch * args.seq * args.accumulation  # per optimizer step
    tp = strata.throughput(model_flops_per_token(params, args), tokens, step_s, 1, args.peak_flops)
    r = {
        "peer": name,
        "step_s": step_s,
        "tokens_per_s": tp["tokens_per_s"],
        "tflops": tp["tflops"],
        "mfu": tp["mfu"],
        "phases_s": {k: statistics.median(v) for k, v in phases.items() if k != "total"},
        "losses": losses,
        "host_peak_bytes": host_peak_bytes(),
    }
    if device.type == "cuda":
        r["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    r.update(extra)
    return r


def dtype_of(args):
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]


def zero3_offload_config(args):
    """The DeepSpeed-schema config Strata and DeepSpeed both train with."""
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch,
        # (bench/peers/train_peers.py passes its own arguments, without --accumulation.)
        "gradient_accumulation_steps": getattr(args, "accumulation", 1),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            # Sub-groups of 1e8 elements (DeepSpeed's default is 1e9): Strata's CPU-Adam
            # reads the device's gradient sums a sub-group at a time, so the host holds the
            # sums of two or three sub-groups, not of the whole partition (5B parameters:
            # 1.2 GB of buffers instead of 20 GB of accumulators).
            "sub_group_size": 100000000,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu" if args.offload_param else "none"},
        },
    }
    if args.dtype != "fp32":
        cfg[args.dtype] = {"enabled": True}
    return cfg


def parse_strata_variant(peer):
    """'strata:KEY=JSON+KEY=JSON' -> {KEY: value}; ValueError naming what is wrong."""
    sets = {}
    for kv in peer.partition(":")[2].split("+"):
        key, eq, value = kv.partition("=")
        if not eq or not key:
            raise ValueError(f"peer {peer!r}: expected strata:KEY=JSON[+KEY=JSON...], e.g. "
                             "strata:accumulate_in_background=false")
        try:
            sets[key] = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"peer {peer!r}: the value of {key} is not JSON ({exc})") from None
    return sets


def set_config_key(cfg, key, value):
    """Sets strata.KEY, or with a dotted KEY the path from the config's root."""
    *path, last = key.split(".") if "." in key else ["strata", key]
    for name in path:
        node = cfg.setdefault(name, {})
        if not isinstance(node, dict):
            raise ValueError(f"config key {key!r}: {name!r} is not a section")
        cfg = node
    cfg[last] = value


def run_strata(args, device, early=False, peer=None):
    import strata

    name = peer or ("strata-early" if early else "strata")
    model = make_model(args)
    params = sum(p.numel() for p in model.parameters())
    cfg = zero3_offload_config(args)
    cfg["strata"] = {"device": device.type, "device_budget": args.device_budget}
    sets = dict(args.strata_set)
    if early:
        sets.update({"early_step": True, "skip_inf_nan_steps": False})
    suffix = "-early" if early else ""
    if peer:
        variant = parse_strata_variant(peer)
        sets.update(variant)
        suffix = "-" + "-".join(f"{k}={json.dumps(v)}" for k, v in variant.items())
        suffix = "".join(c if c.isalnum() or c in "-_=." else "_" for c in suffix)
    for key, value in sets.items():
        set_config_key(cfg, key, value)
    trace = args.trace
    if trace and suffix:
        stem, ext = os.path.splitext(trace)
        trace = f"{stem}{suffix}{ext}"
    # The blocks are the groups; the embedding (used again by the tied head outside its
    # own forward), the positions and the final norm stay in the root group.
    engine, *_ = strata.initialize(model=model, config=cfg, blocks=list(model.blocks))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def forward(x, y):
        return loss_of(engine(x), y)

    if trace:
        engine.enable_timeline()
    phases, losses = run_loop(args, device, forward, engine.backward, engine.step, step_every_micro_step=True)
    if trace:
        engine.write_trace(trace)
    st = engine.statistics()
    extra = {
        "strata_device_arena_peak_bytes": st["device"]["peak_bytes"],
        "strata_host_tier_peak_bytes": (st["host"] or {}).get("peak_bytes", 0),
        "exposed_s_per_step": {
            "all_gather": st["coordinator"]["all_gather_wait_s"],
            "shard_staging": st["coordinator"]["staging_wait_s"],
            "compute_before_reduce": st["reducer"]["compute_wait_s"],
            "reduce": st["reducer"]["reduce_wait_s"],
            "reduced_shard_copy": st["reducer"]["shard_copy_wait_s"],
            # The reducer's thread (strata.accumulate_in_background): the backward waited
            # for it to add a bucket's shards.
            "shard_accumulation": st["reducer"]["accumulate_wait_s"],
            "working_shard_copy": st["working_push_wait_s"],
            "optimizer_step": st["optimizer"]["step_s"],
            # The next forward's waits for the pipelined step's group updates.
            "step_updates": st["optimizer"]["pipelined_wait_s"],
        },
    }
    n = args.warmup + args.steps
    extra["exposed_s_per_step"] = {k: v / n for k, v in extra["exposed_s_per_step"].items()}
    # The pipelined update's wall time per step, from its start (step(), or the backward
    # with the early step) to its last group: it runs beside the next forward, so it is in
    # the step time only where waited on ("step_updates").
    pipelined = st["optimizer"]["steps_pipelined"]
    extra["pipelined_update_s_per_step"] = st["optimizer"]["pipelined_update_s"] / pipelined if pipelined else None
    extra["strata_set"] = sets
    # Where the micro-steps' gradients were summed (strata.accumulate_on_device) and where
    # CPU-Adam read them (the device's sums, or host accumulators), the reduced-gradient
    # copies device->host per optimizer step with their bytes (the reducer's, and the
    # sub-groups of device sums the step copied), and the host memory the optimizer holds
    # per trainable parameter (its store's memory: states, or NVMe buffers; and the
    # sums' buffers).
    extra["gradient_accumulation"] = st["gradient_accumulation"]
    extra["grad_accumulators"] = st["grad_accumulators"]
    sums = st["device_sums"]
    extra["grad_copies_per_step"] = (st["reducer"]["shard_copies"] + sums["fetches"]) / n
    extra["grad_copy_bytes_per_step"] = (st["reducer"]["shard_copy_bytes"] + sums["fetch_bytes"]) / n
    # (One rank; every parameter of the bench's GPT is trained.)
    extra["optimizer_host_bytes_per_param"] = (
        (st["optimizer_store"]["memory_bytes"] + sums["buffer_bytes"]) / params)
    extra["steps_early"] = st["optimizer"]["steps_early"]
    # The delayed update (strata.delayed_update): its steps, the copy-outs of its parameters
    # into the working shards (inside step()) and the engine's waits for it, per step.
    extra["delayed_update_steps"] = st["delayed_update_steps"]
    extra["delayed_copy_out_s_per_step"] = st["delayed_copy_out_s"] / n
    extra["delayed_update_wait_s_per_step"] = st["delayed_update_wait_s"] / n
    # The early step: groups whose update started during the backward, per early step, of
    # the engine's groups (the rest go when the backward ends).
    steps_early = extra["steps_early"]
    extra["groups_released_in_backward_per_step"] = (
        st["optimizer"]["groups_released_in_backward"] / steps_early if steps_early else None)
    extra["groups"] = len(engine.groups())
    # The gradient norm's tiles summed during the backward (the norm thread, or the early
    # step's worker) against those left to step().
    # (and those summed as the reduced gradients were written, never read back).
    for k in ("norms_in_backward", "norms_in_backward_dropped", "norm_tiles_in_background", "norm_tiles_in_step",
              "norm_tiles_as_written"):
        extra[k] = st["optimizer"][k]
    # Of step(), the seconds summing this rank's norm (the tiles left), per step.
    extra["norm_s_per_step"] = st["optimizer"]["norm_s"] / n
    # Gradient buckets reduced per step, and of them those launched during the backward
    # (zero_optimization.reduce_bucket_size: fewer, larger buckets leave more to its end).
    extra["buckets_per_step"] = st["reducer"]["buckets_reduced"] / n
    extra["buckets_launched_in_backward_per_step"] = st["reducer"]["buckets_launched_in_backward"] / n
    # Bytes reduce-scattered per step (a group reduced twice counts twice), and the gradients
    # the reducer's park held until their group's slot opened (docs/engine/reduce.md, "The park").
    extra["reduce_scatter_bytes_per_step"] = st["reducer"]["reduce_scatter_bytes"] / n
    extra["gradients_parked_per_step"] = st["reducer"].get("gradients_parked", 0) / n
    # Gradient elements written into accumulators known zero (not read), per step.
    extra["acc_elements_added_to_zero_per_step"] = st["optimizer"]["acc_elements_added_to_zero"] / n
    # Lazy zeroing: accumulator chunks left in place instead of zeroed, and stale elements
    # zeroed before a read (no gradient wrote over them), per step.
    extra["acc_chunks_zeroed_lazily_per_step"] = st["optimizer"]["acc_chunks_zeroed_lazily"] / n
    extra["acc_stale_elements_zeroed_per_step"] = st["optimizer"]["acc_stale_elements_zeroed"] / n
    # The host's waits on the device (docs/engine/device.md, "Every wait of a step"): those of the
    # last timed step by name, and the device's total per step (warm-up included).
    ops = st.get("device_ops")
    if ops is not None:
        extra["host_waits_last_step"] = {k: v for k, v in ops["host_waits_last_step"].items() if v}
        extra["host_waits_per_step"] = ops["host_waits_total"] / n
    if device.type == "cuda":
        extra["device_peak_bytes_total"] = torch.cuda.max_memory_allocated(device) + st["device"]["peak_bytes"]
    engine.close()
    return summarize(name, args, device, params, phases, losses, extra)


def run_torch(args, device):
    model = make_model(args).to(device)
    params = sum(p.numel() for p in model.parameters())
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, fused=fused)
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "fp16")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    amp = args.dtype != "fp32"

    def forward(x, y):
        with torch.autocast(device.type, dtype=dtype_of(args), enabled=amp):
            return loss_of(model(x), y)

    def backward(loss):
        scaler.scale(loss / args.accumulation).backward()

    def step():
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    phases, losses = run_loop(args, device, forward, backward, step)
    return summarize("torch", args, device, params, phases, losses, {})


def run_fsdp2(args, device):
    if device.type != "cuda":
        raise RuntimeError("FSDP2 with CPUOffloadPolicy needs CUDA")
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29577")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    model = make_model(args)
    params = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=dtype_of(args), reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
    fully_shard(model, offload_policy=CPUOffloadPolicy(), mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    torch.cuda.reset_peak_memory_stats(device)

    def forward(x, y):
        return loss_of(model(x), y)

    def backward(loss):
        (loss / args.accumulation).backward()

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    phases, losses = run_loop(args, device, forward, backward, step)
    return summarize("fsdp2", args, device, params, phases, losses, {})


def run_deepspeed(args, device):
    import deepspeed  # installed by bench/peers/install.sh; ImportError otherwise
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29578")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    model = make_model(args)
    params = sum(p.numel() for p in model.parameters())
    cfg = zero3_offload_config(args)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def forward(x, y):
        return loss_of(engine(x), y)

    phases, losses = run_loop(args, device, forward, engine.backward, engine.step, step_every_micro_step=True)
    return summarize("deepspeed", args, device, params, phases, losses, {})


RUNNERS = {
    "strata": run_strata,
    "strata-early": lambda args, device: run_strata(args, device, early=True),
    "torch": run_torch,
    "fsdp2": run_fsdp2,
    "deepspeed": run_deepspeed,
}


# GPT presets (the model above: tied embedding, vocab 32000, seq 1024): about 12 x layers x
# dim^2 + vocab x dim parameters. "5b" is the largest whose host state fits a 128 GiB GPU
# machine with the optimizer on the host for every peer (DeepSpeed: 16 bytes per parameter,
# fp32 master, m, v and gradients; Strata with --accumulation K > 1: 12, its CPU-Adam reading
# the device's gradient sums; `strata-config plan` says it for a config), "tiny" and "small"
# run on the CPU.
PRESETS = {
    "tiny": {"order": 0, "layers": 2, "dim": 64, "heads": 4, "vocab": 256, "seq": 32},
    "small": {"order": 1, "layers": 4, "dim": 256, "heads": 4, "vocab": 8000, "seq": 128},
    "1.3b": {"order": 2, "layers": 24, "dim": 2048, "heads": 16, "vocab": 32000, "seq": 1024},
    "2.7b": {"order": 3, "layers": 32, "dim": 2560, "heads": 20, "vocab": 32000, "seq": 1024},
    "5b": {"order": 4, "layers": 40, "dim": 3200, "heads": 25, "vocab": 32000, "seq": 1024},
}


def gib(b):
    return f"{b / 2**30:.2f} GiB"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", choices=sorted(PRESETS, key=lambda k: PRESETS[k]["order"]), default="1.3b",
                    help="a preset of --layers, --dim, --heads, --vocab and --seq (each flag given overrides it)")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--dim", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int, default=8, help="the micro-batch (sequences per micro-step)")
    ap.add_argument("--accumulation", type=int, default=1, metavar="K",
                    help="micro-steps per optimizer step (gradient_accumulation_steps): each timed step is K "
                         "forwards and backwards and one optimizer step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--offload-param", action="store_true")
    ap.add_argument("--device-budget", type=int, default=0, help="strata.device_budget in bytes (0: the default)")
    ap.add_argument("--peers", default="strata,torch,fsdp2,deepspeed")
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="the device's peak for MFU (default: a GPU's datasheet, or this CPU's measured GEMM peak)")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--strata-set", action="append", default=[], metavar="KEY=JSON",
                    help="a strata.* config key for the strata peer, e.g. early_step=true (repeatable)")
    ap.add_argument("--trace", help="the strata peer's timeline of every step as Chrome/Perfetto trace JSON")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the peers this many times in turn and end with each one's median step time")
    args = ap.parse_args(argv)
    sets = {}
    for kv in args.strata_set:
        key, eq, value = kv.partition("=")
        if not eq or not key:
            ap.error(f"--strata-set {kv!r}: expected KEY=JSON, e.g. early_step=true")
        try:
            sets[key] = json.loads(value)
        except json.JSONDecodeError as exc:
            ap.error(f"--strata-set {kv!r}: the value is not JSON ({exc})")
    args.strata_set = sets
    for key, value in PRESETS[args.model].items():
        if key != "order" and getattr(args, key) is None:
            setattr(args, key, value)
    if args.accumulation < 1:
        ap.error("--accumulation must be at least 1")
    if args.dim % args.heads:
        ap.error("--dim must be a multiple of --heads")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be at least 1 and --warmup at least 0")
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p.startswith("strata:"):
            try:
                parse_strata_variant(p)
            except ValueError as exc:
                ap.error(str(exc))
        elif p not in RUNNERS:
            ap.error(f"unknown peer {p} ({', '.join(RUNNERS)}, or strata:KEY=JSON[+KEY=JSON...])")
    if len(set(peers)) != len(peers):
        ap.error("--peers names a peer twice (use --rounds to run them again)")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.peak_tflops < 0:
        ap.error("--peak-tflops must be positive")
    probe = make_model(args)
    params = sum(p.numel() for p in probe.parameters())
    del probe
    args.peak_flops, args.peak_source = peak_flops(args, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"train_bench: {params / 1e6:.1f}M parameters ({args.model}: {args.layers} layers, dim {args.dim}, "
        f"{args.heads} heads, vocab {args.vocab}), micro-batch {args.batch} x seq {args.seq} x {args.accumulation} "
        f"micro-step(s) per optimizer step, {args.dtype}, on {where}; "
        f"{args.warmup} warm-up + {args.steps} timed steps, medians; torch {torch.__version__}; "
        f"MFU against {args.peak_flops / 1e12:.3g} TFLOPS ({args.peak_source})",
        flush=True,
    )
    results = []

    def write_json():
        # After every peer, so that a run cut short (a lease's time limit) still reports.
        if args.json:
            tmp = args.json + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"args": vars(args), "parameters": params, "device": where, "results": results}, f,
                          indent=1)
            os.replace(tmp, args.json)

    for rnd, p in ((k, p) for k in range(args.rounds) for p in peers):
        if p == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
            if rnd == 0:
                print("  deepspeed: not installed (bench/peers/install.sh installs it)", flush=True)
            continue
        if args.rounds > 1 and p == peers[0]:
            print(f" round {rnd + 1} of {args.rounds}", flush=True)
        try:
            if p.startswith("strata:"):
                r = run_strata(args, device, peer=p)
            else:
                r = RUNNERS[p](args, device)
        except Exception as exc:  # a failing peer is reported, the others still run
            print(f"  {p}: FAILED: {type(exc).__name__}: {exc}", flush=True)
            results.append({"peer": p, "round": rnd, "error": f"{type(exc).__name__}: {exc}"})
            write_json()
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        ph = r["phases_s"]
        line = (
            f"  {p}: {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.2f} TFLOPS "
            f"(MFU {100 * r['mfu']:.1f}%); "
            f"forward {ph['forward'] * 1e3:.1f} ms, backward {ph['backward'] * 1e3:.1f} ms, step {ph['step'] * 1e3:.1f} ms; "
            f"host peak {gib(r['host_peak_bytes'])}"
        )
        if "device_peak_bytes" in r:
            line += f", device peak {gib(r.get('device_peak_bytes_total', r['device_peak_bytes']))}"
        if p.startswith("strata"):
            ex = r["exposed_s_per_step"]
            line += "\n    strata waited per step (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in ex.items())
            line += f"; arena peak {gib(r['strata_device_arena_peak_bytes'])}, host tier peak {gib(r['strata_host_tier_peak_bytes'])}"
            if r["pipelined_update_s_per_step"] is not None:
                line += f"\n    the pipelined update ran {r['pipelined_update_s_per_step'] * 1e3:.1f} ms per step from its start to its last group"
            if r["groups_released_in_backward_per_step"] is not None:
                line += (f"; {r['groups_released_in_backward_per_step']:.1f} of {r['groups']} groups' updates "
                         f"started during the backward per step")
            line += (
                f"\n    gradient norm: {r['norms_in_backward']} steps summed in the backward "
                f"({r['norms_in_backward_dropped']} dropped); tiles summed beside the backward "
                f"{r['norm_tiles_in_background']}, in step() {r['norm_tiles_in_step']} "
                f"({r['norm_s_per_step'] * 1e3:.1f} ms per step), as written {r['norm_tiles_as_written']}; "
                f"{r['acc_elements_added_to_zero_per_step'] / 1e6:.1f}M gradient elements per step "
                f"written into zeroed accumulators without reading them; "
                f"{r['acc_chunks_zeroed_lazily_per_step']:.1f} accumulator chunks per step left in place "
                f"(lazy zeroing), {r['acc_stale_elements_zeroed_per_step'] / 1e6:.2f}M stale elements zeroed"
                f"\n    gradient buckets per step: {r['buckets_per_step']:.1f} reduced, "
                f"{r['buckets_launched_in_backward_per_step']:.1f} of them launched during the backward, "
                f"{r['reduce_scatter_bytes_per_step'] / 2**20:.1f} MiB reduce-scattered, "
                f"{r['gradients_parked_per_step']:.1f} gradients parked"
            )
            if "host_waits_last_step" in r:
                last = r["host_waits_last_step"]
                line += (f"\n    host waits on the device: {r['host_waits_per_step']:.1f} per step; the last step "
                         f"{sum(last.values())}: " + (", ".join(f"{k} {v}" for k, v in last.items()) or "none"))
            line += (f"\n    gradient accumulation: {r['gradient_accumulation']}; "
                     f"{r['grad_copies_per_step']:.1f} reduced-gradient copies device->host per optimizer step "
                     f"({r['grad_copy_bytes_per_step'] / 2**20:.1f} MiB); accumulators CPU-Adam reads: "
                     f"{r['grad_accumulators']}; optimizer host memory "
                     f"{r['optimizer_host_bytes_per_param']:.2f} B per parameter")
            if r["delayed_update_steps"]:
                line += (f"\n    delayed update (not exact): {r['delayed_update_steps']} steps beside the next "
                         f"micro-steps; copy-out {r['delayed_copy_out_s_per_step'] * 1e3:.1f} ms per step, "
                         f"waited {r['delayed_update_wait_s_per_step'] * 1e3:.1f} ms per step")
            if r["strata_set"]:
                line += f"; strata keys set: {json.dumps(r['strata_set'])}"
        line += f"\n    losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
        print(line, flush=True)
        r["round"] = rnd
        results.append(r)
        write_json()
    if args.rounds > 1:
        print(f"medians over {args.rounds} rounds (ms/step; forward / backward / step):", flush=True)
        for p in peers:
            rs = [r for r in results if r["peer"] == p and "error" not in r]
            if not rs:
                continue
            med = {k: statistics.median(r["phases_s"][k] for r in rs) for k in ("forward", "backward", "step")}
            each = ", ".join(f"{r['step_s'] * 1e3:.1f}" for r in rs)
            print(f"  {p}: {statistics.median(r['step_s'] for r in rs) * 1e3:.1f} ({each}); "
                  f"{med['forward'] * 1e3:.1f} / {med['backward'] * 1e3:.1f} / {med['step'] * 1e3:.1f}", flush=True)
    write_json()
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
