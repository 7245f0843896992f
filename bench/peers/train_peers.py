#!/usr/bin/env python3
"""train_peers: one training step of Strata beside DeepSpeed ZeRO-3 and FSDP2 on the CPU,
1 and 2 ranks, interleaved.

    .venv/bin/python bench/peers/train_peers.py [--model small|medium|large] [--batch B]
        [--ranks 1,2] [--repeats 3] [--steps 8 --warmup 2] [--peers strata,deepspeed,fsdp2]
        [--dtype bf16|fp32] [--json FILE]

Every peer trains the GPT of bench/train_bench.py at the shape of a strata-train preset
(byte vocabulary of 256, the preset's layers, width, heads and context; --model) from
the same initial values, each rank on its own random tokens (the same for every peer),
on the CPU with gloo:

- strata:    strata.initialize, ZeRO-3, the optimizer offloaded to the host (CPU-Adam),
             the blocks as groups; its own communicator (torchrun's environment).
- deepspeed: DeepSpeed ZeRO-3 with offload_optimizer = cpu on its CPU accelerator
             (DS_ACCELERATOR=cpu, deepspeed.init_distributed("gloo")), the same config.
- fsdp2:     torch.distributed.fsdp.fully_shard per block and on the root, gloo,
             MixedPrecisionPolicy(--dtype, fp32 reductions), torch.optim.AdamW.
- torch:     (1 rank only) the unsharded model under autocast with AdamW: the "where it
             fits" reference.

Each (ranks, peer) runs in a fresh torchrun group, so each rank's peak resident memory
(ru_maxrss, reported beside the resident size just after the imports) is its own peer's.
Rounds are interleaved: round r runs the peers in the order rotated by r, so a shared
machine's drift hits all alike. Reported per peer and rank count: the median over rounds
of each round's median step time (rank 0's clock; every step ends in the peer's own
collectives), its forward / backward / step phases, the largest per-rank peak and the
first and last loss. torch threads per rank = cores / ranks (--threads overrides).

DeepSpeed comes from bench/peers/install.sh (without it the other peers run and the
output says so); a peer that fails is reported with its command and the last lines of
its error, and the others still run (the exit status is then 1).
"""

import argparse
import importlib.util
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)

# strata-train's presets (core/model_shapes.cc): layers, d_model, heads, seq_len.
PRESETS = {"tiny": (4, 32, 2, 32), "small": (12, 64, 4, 64), "medium": (8, 128, 4, 128), "large": (12, 512, 8, 256)}
PEERS = ("strata", "deepspeed", "fsdp2", "torch")


def rss_peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_now_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def model_args(args):
    layers, dim, heads, seq = PRESETS[args.model]
    return argparse.Namespace(vocab=256, dim=dim, layers=layers, heads=heads, seq=seq, batch=args.batch,
                              dtype=args.dtype, offload_param=False, device_budget=0)


# ----------------------------------------------------------------------------- worker


def build_strata(margs, rank, world):
    import strata
    import train_bench as tb

    model = tb.make_model(margs)
    cfg = tb.zero3_offload_config(margs)
    cfg["strata"] = {"device": "cpu"}
    engine, *_ = strata.initialize(model=model, config=cfg, blocks=list(model.blocks))

    def forward(x, y):
        return tb.loss_of(engine(x), y)

    return forward, engine.backward, engine.step, engine.close


def build_deepspeed(margs, rank, world):
    import deepspeed
    import torch.distributed as dist
    import train_bench as tb

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    model = tb.make_model(margs)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=tb.zero3_offload_config(margs))

    def forward(x, y):
        return tb.loss_of(engine(x), y)

    return forward, engine.backward, engine.step, lambda: None


def build_fsdp2(margs, rank, world):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    import train_bench as tb

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = tb.make_model(margs)
    mp = MixedPrecisionPolicy(param_dtype=tb.dtype_of(margs), reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)

    def forward(x, y):
        return tb.loss_of(model(x), y)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward, lambda loss: loss.backward(), step, dist.destroy_process_group


def build_torch(margs, rank, world):
    import torch
    import train_bench as tb

    if world != 1:
        raise RuntimeError("the unsharded torch reference runs on 1 rank only")
    model = tb.make_model(margs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    amp = margs.dtype != "fp32"

    def forward(x, y):
        with torch.autocast("cpu", dtype=tb.dtype_of(margs), enabled=amp):
            return tb.loss_of(model(x), y)

    def step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return forward, lambda loss: loss.backward(), step, lambda: None


BUILDERS = {"strata": build_strata, "deepspeed": build_deepspeed, "fsdp2": build_fsdp2, "torch": build_torch}


def worker(args):
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    sys.path.insert(0, BENCH)
    import torch

    torch.set_num_threads(args.threads)
    if args.peer == "deepspeed":
        import deepspeed  # noqa: F401  (its import is part of its resident baseline)
    if args.peer == "strata":
        import strata  # noqa: F401
    rss_after_imports = rss_now_bytes()
    margs = model_args(args)
    result = {"peer": args.peer, "rank": rank, "world": world, "rss_after_imports": rss_after_imports}
    try:
        forward, backward, step, close = BUILDERS[args.peer](margs, rank, world)
        g = torch.Generator().manual_seed(1000 + rank)
        times, losses = {"forward": [], "backward": [], "step": [], "total": []}, []
        for i in range(args.warmup + args.steps):
            t = torch.randint(0, margs.vocab, (margs.batch, margs.seq + 1), generator=g)
            x, y = t[:, :-1], t[:, 1:]
            t0 = time.perf_counter()
            loss = forward(x, y)
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            step()
            t3 = time.perf_counter()
            losses.append(float(loss.item()))
            if i >= args.warmup:
                for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2), ("total", t3 - t0)):
                    times[k].append(v)
        close()
        result.update(times=times, losses=losses)
    except Exception as exc:  # reported by the driver; the other peers still run
        import traceback

        result["error"] = "".join(traceback.format_exception(exc))[-1500:]
    result["rss_peak"] = rss_peak_bytes()
    with open(os.path.join(args.out, f"{args.peer}-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return 0 if "error" not in result else 1


# ----------------------------------------------------------------------------- driver


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, peer, ranks, threads, out):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone" if ranks == 1 else "--nnodes=1", f"--nproc-per-node={ranks}"]
    if ranks > 1:
        cmd += [f"--master-port={free_port()}"]
    cmd += [os.path.abspath(__file__), "--worker", "--peer", peer, "--out", out, "--threads", str(threads),
            "--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--dtype", args.dtype]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    per_rank = []
    for r in range(ranks):
        path = os.path.join(out, f"{peer}-rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                per_rank.append(json.load(f))
            os.remove(path)
    errors = [r["error"] for r in per_rank if "error" in r]
    if p.returncode != 0 or len(per_rank) != ranks or errors:
        tail = errors[0] if errors else p.stdout[-1500:]
        return {"error": f"{' '.join(cmd)}\n(exit {p.returncode})\n{tail}"}
    r0 = per_rank[0]
    return {
        "step_s": statistics.median(r0["times"]["total"]),
        "phases_s": {k: statistics.median(v) for k, v in r0["times"].items() if k != "total"},
        "losses": r0["losses"],
        "rss_peak": max(r["rss_peak"] for r in per_rank),
        "rss_after_imports": max(r["rss_after_imports"] for r in per_rank),
        "wall_s": wall,
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(PRESETS), default="small", help="strata-train preset (default small)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank (default 8)")
    ap.add_argument("--ranks", default="1,2", help="rank counts to run (default 1,2)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--peers", default="strata,deepspeed,fsdp2,torch")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (default: cores / ranks)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    ap.add_argument("--json", help="also write the results to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--peer", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p not in PEERS:
            ap.error(f"unknown peer {p} ({', '.join(PEERS)})")
    ranks_list = [int(r) for r in args.ranks.split(",")]
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or min(ranks_list) < 1:
        ap.error("--steps, --repeats and --ranks must be at least 1, --warmup at least 0")
    if "deepspeed" in peers and importlib.util.find_spec("deepspeed") is None:
        print("train_peers: deepspeed is not installed (bench/peers/install.sh installs it); "
              "running the other peers", flush=True)
        peers.remove("deepspeed")
    cores = os.cpu_count()
    layers, dim, heads, seq = PRESETS[args.model]
    import torch

    print(f"train_peers: strata-train's '{args.model}' shape ({layers} layers, d_model {dim}, {heads} heads, "
          f"seq {seq}, vocab 256), batch {args.batch} per rank, {args.dtype}, CPU, {cores} cores; "
          f"{args.warmup} warm-up + {args.steps} timed steps, {args.repeats} interleaved rounds; "
          f"torch {torch.__version__}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="train_peers-") as out:
        for ranks in ranks_list:
            threads = args.threads or max(1, cores // ranks)
            run_peers = [p for p in peers if not (p == "torch" and ranks != 1)]
            for rnd in range(args.repeats):
                order = run_peers[rnd % len(run_peers):] + run_peers[: rnd % len(run_peers)]
                for peer in order:
                    r = launch(args, peer, ranks, threads, out)
                    results.setdefault((ranks, peer), []).append(r)
                    what = f"{r['step_s'] * 1e3:.1f} ms/step" if "error" not in r else "FAILED"
                    print(f"  round {rnd + 1}, {ranks} rank(s), {peer}: {what}", flush=True)
    rows = []
    for (ranks, peer), runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            rows.append({"ranks": ranks, "peer": peer, "error": runs[0]["error"]})
            continue
        rows.append({
            "ranks": ranks, "peer": peer, "rounds": len(ok),
            "step_s": statistics.median(r["step_s"] for r in ok),
            "step_s_rounds": [r["step_s"] for r in ok],
            "phases_s": {k: statistics.median(r["phases_s"][k] for r in ok) for k in ok[0]["phases_s"]},
            "rss_peak": statistics.median(r["rss_peak"] for r in ok),
            "rss_after_imports": statistics.median(r["rss_after_imports"] for r in ok),
            "loss_first": ok[0]["losses"][0], "loss_last": ok[0]["losses"][-1],
        })
    print(f"{'ranks':>5} {'peer':<10} {'ms/step':>9} {'fwd/bwd/step ms':>22} {'peak RSS/rank':>14} "
          f"{'after imports':>14} {'growth':>9} {'loss first->last':>18} {'vs strata':>9}")
    for ranks in ranks_list:
        base = next((r for r in rows if r["ranks"] == ranks and r["peer"] == "strata" and "error" not in r), None)
        for r in (r for r in rows if r["ranks"] == ranks):
            if "error" in r:
                print(f"{ranks:>5} {r['peer']:<10} FAILED:\n{r['error']}")
                continue
            ph = r["phases_s"]
            rel = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
            print(f"{ranks:>5} {r['peer']:<10} {r['step_s'] * 1e3:>9.1f} "
                  f"{ph['forward'] * 1e3:>7.1f}/{ph['backward'] * 1e3:.1f}/{ph['step'] * 1e3:.1f} "
                  f"{r['rss_peak'] / 2**20:>10.0f} MiB {r['rss_after_imports'] / 2**20:>10.0f} MiB "
                  f"{(r['rss_peak'] - r['rss_after_imports']) / 2**20:>5.0f} MiB "
                  f"{r['loss_first']:>8.4f}->{r['loss_last']:.4f} {rel:>9}")
    print("growth: the peak over the resident size after the imports (the training's own memory); "
          "vs strata: the peer's step time over Strata's (above 1: Strata is faster)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
