#!/usr/bin/env python3
"""overlap_bench: strata-train's step with the gradient reduction's overlap, the pipelined
CPU step and the early step off and on, and where each step's time went.

    .venv/bin/python bench/overlap_bench.py [--model medium] [--ranks 1,2] [--steps 40]
        [--warmup 5] [--rounds 3] [--threads N] [--modes off,comm,on,nonorm,noclip,early]
        [--json FILE]
        [--nvme DIR [--sub-group-size 262144] [--nvme-buffers 16]]
        [--strata-train build/bin/strata-train]

Six configurations of strata-train's embedded default (`--print-config`), everything
else equal:
  off   overlap_comm false, reduce_bucket_size 1: one bucket, each group reduced alone and
        waited for before the next group's gradients can land, and the CPU step inside
        step() (strata.pipeline_step false), its gradient-norm pass too
        (strata.norm_in_backward false): the main job until 2026-11-26;
  comm  overlap_comm true, reduce_bucket_size one block: two buckets, each block's
        reduce-scatter in flight while the next block's backward runs; the step inside
        step();
  on    both, and the pipelined step (the default now): step() starts the CPU update,
        which runs group by group beside the next forward; the gradient-norm pass runs
        during the backward (strata.norm_in_backward, the default too);
  nonorm  "on" with strata.norm_in_backward false: the norm pass inside step();
  noclip  "on" with gradient_clipping 0 and strata.skip_inf_nan_steps false;
  early   "noclip" with strata.early_step: each group's update starts during the backward
        once its gradient is final.
Each runs on 1 rank and on 2 ranks under the venv's torchrun (one LibTorch thread per rank
on several ranks, all cores on one; --threads sets it), in interleaved rounds (the order
rotated every round). CPU-Adam uses all cores in every mode. Reported per mode
and rank count, medians over the rounds of each run's median over the steps after
--warmup: the step's wall time (from --metrics' elapsed_s), its forward, backward and
optimizer-step phases (step() itself: with the pipeline only the norm and the update's
start), the time the engine's thread waited in it, and the run's mean wait per step by kind
(strata-train's end-of-run "per step" line, the waits for the pipelined update's groups
included). The losses of off, comm and on must agree exactly, and those of noclip and early
(neither the bucketing, the update's order nor its start changes a result); the program
checks it.
With --nvme DIR the optimizer states live in swap files under DIR (offload_optimizer
device nvme, --sub-group-size elements per sub-group, --nvme-buffers buffers, reads ahead
and writes behind): "on" then streams the sub-groups through the store on the update's
worker in the order the next forward needs them; noclip and early are not run (the early
step needs the states in memory).
"""

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile

PER_STEP = re.compile(r"per step \(ms, mean of \d+\): forward ([\d.]+), backward ([\d.]+), optimizer step ([\d.]+) "
                      r"\(pipelined steps: (\d+), of which early: (\d+) with (\d+) groups updated during the backward; "
                      r"their updates ran ([\d.]+) beside the backward and the next forward\); "
                      r"the engine's thread waited ([\d.]+): all-gathers ([\d.]+), shard staging ([\d.]+), "
                      r"the step's updates ([\d.]+), "
                      r"compute before reductions ([\d.]+), reductions ([\d.]+), reduced-shard copies ([\d.]+), "
                      r"the reducer's thread ([\d.]+), working-shard pushes ([\d.]+), NVMe ([\d.]+)")
WAITS = ("all_gathers", "shard_staging", "step_updates", "compute_before_reductions", "reductions",
         "reduced_shard_copies", "reducer_thread", "working_shard_pushes", "nvme")
MODES = ("off", "comm", "on", "nonorm", "noclip", "early")
# The modes whose losses must agree: clipping changes them (the early step needs it off).
SAME_AS = {"off": "off", "comm": "off", "on": "off", "nonorm": "off", "noclip": "noclip", "early": "noclip"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_once(args, cfg_path, ranks, work):
    metrics = os.path.join(work, "m.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = [args.strata_train, "--model", args.model, "--steps", str(args.steps), "--config", cfg_path,
           "--metrics", metrics, "--no-progress", "--max-loss-ratio", "0"]
    threads = args.threads if args.threads > 0 else (1 if ranks > 1 else os.cpu_count())
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if ranks > 1:
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [torchrun, f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "--no_python"] + cmd
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"overlap_bench: {' '.join(cmd)} failed (exit {p.returncode}):\n{p.stdout[-3000:]}")
    rows = [json.loads(line) for line in open(metrics)]
    m = PER_STEP.search(p.stdout)
    if not m:
        sys.exit("overlap_bench: no per-step line in strata-train's output")
    waits = dict(zip(WAITS, (float(x) for x in m.groups()[8:])))
    timed = rows[args.warmup:]
    prev = rows[args.warmup - 1]["elapsed_s"] if args.warmup > 0 else 0.0
    walls = []
    for r in timed:
        walls.append(r["elapsed_s"] - prev)
        prev = r["elapsed_s"]
    med = statistics.median
    return {
        "step_ms": med(walls) * 1e3,
        "forward_ms": med(r["forward_s"] for r in timed) * 1e3,
        "backward_ms": med(r["backward_s"] for r in timed) * 1e3,
        "optimizer_ms": med(r["step_s"] for r in timed) * 1e3,
        "waited_ms": med(r["waited_s"] for r in timed) * 1e3,
        "waits_ms": waits,
        "losses": [r["loss"] for r in rows],
        "pipelined_steps": int(m.group(4)),
        "early_steps": int(m.group(5)),
        "groups_in_backward": int(m.group(6)),
        "update_ms": float(m.group(7)),
        "buckets": re.search(r"gradient buckets: .*", p.stdout).group(0),
    }


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="medium")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="LibTorch threads per rank (OMP_NUM_THREADS); 0: all cores on 1 rank, 1 on several")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="the modes to run (each with the mode whose losses it must match)")
    ap.add_argument("--json")
    ap.add_argument("--nvme", help="a directory for the optimizer states' swap files (offload_optimizer nvme)")
    ap.add_argument("--sub-group-size", type=int, default=262144, help="with --nvme: sub_group_size")
    ap.add_argument("--nvme-buffers", type=int, default=16, help="with --nvme: offload_optimizer.buffer_count")
    ap.add_argument("--strata-train", default=os.path.join(root, "build", "bin", "strata-train"))
    args = ap.parse_args(argv)
    if args.steps <= args.warmup or args.rounds < 1:
        ap.error("--steps must exceed --warmup and --rounds be at least 1")
    ranks_list = [int(r) for r in args.ranks.split(",")]
    wanted = args.modes.split(",")
    for m in wanted:
        if m not in MODES:
            ap.error(f"--modes: unknown mode {m!r} (known: {', '.join(MODES)})")
    if args.nvme:
        if not os.path.isdir(args.nvme):
            ap.error(f"--nvme: {args.nvme!r} is not a directory")
        if any(m in ("noclip", "early") for m in wanted):
            if args.modes != ",".join(MODES):
                ap.error("--nvme: the modes noclip and early are not run (the early step needs the states in memory)")
            wanted = [m for m in wanted if m not in ("noclip", "early")]
    modes = tuple(m for m in MODES if m in wanted or m in (SAME_AS[w] for w in wanted))
    with tempfile.TemporaryDirectory(prefix="overlap-bench-") as work:
        base = json.loads(subprocess.run([args.strata_train, "--model", args.model, "--print-config"],
                                         capture_output=True, text=True, check=True).stdout)
        paths = {}
        for mode in modes:
            cfg = json.loads(json.dumps(base))
            if mode == "off":
                cfg["zero_optimization"]["overlap_comm"] = False
                cfg["zero_optimization"]["reduce_bucket_size"] = 1
            cfg.setdefault("strata", {})["pipeline_step"] = mode in ("on", "nonorm", "noclip", "early")
            cfg["strata"]["norm_in_backward"] = mode not in ("off", "comm", "nonorm")
            if mode in ("noclip", "early"):
                cfg["gradient_clipping"] = 0.0
                cfg["strata"]["skip_inf_nan_steps"] = False
                cfg["strata"]["early_step"] = mode == "early"
            if args.nvme:
                zero = cfg["zero_optimization"]
                zero["sub_group_size"] = args.sub_group_size
                zero["offload_optimizer"].update({"device": "nvme", "nvme_path": [args.nvme],
                                                  "buffer_count": args.nvme_buffers,
                                                  "pipeline_read": True, "pipeline_write": True})
            cfg.pop("train_batch_size", None)  # derived again for the rank count
            paths[mode] = os.path.join(work, f"{mode}.json")
            with open(paths[mode], "w") as f:
                json.dump(cfg, f)
        print(f"overlap_bench: strata-train --model {args.model}, {args.steps} steps ({args.warmup} warm-up), "
              f"{args.rounds} interleaved rounds, ranks {args.ranks}, {os.cpu_count()} cores, LibTorch threads per "
              f"rank {args.threads or 'default'}"
              + (f", optimizer states on NVMe in {args.nvme} (sub_group_size {args.sub_group_size}, "
                 f"{args.nvme_buffers} buffers)" if args.nvme else ""), flush=True)
        results = {}
        for ranks in ranks_list:
            for rnd in range(args.rounds):
                k = rnd % len(modes)
                for mode in modes[k:] + modes[:k]:
                    r = run_once(args, paths[mode], ranks, work)
                    results.setdefault((ranks, mode), []).append(r)
                    print(f"  round {rnd + 1}, {ranks} rank(s), overlap {mode}: {r['step_ms']:.1f} ms/step", flush=True)
    out = []
    for ranks in ranks_list:
        for mode in modes:
            ref = SAME_AS[mode]
            if results[(ranks, mode)][0]["losses"] != results[(ranks, ref)][0]["losses"]:
                sys.exit(f"overlap_bench: the losses differ between modes {ref} and {mode} at {ranks} rank(s)")
            for key, want in (("pipelined_steps", args.steps if mode in ("on", "nonorm", "noclip", "early") else 0),
                              ("early_steps", args.steps if mode == "early" else 0)):
                if results[(ranks, mode)][0][key] != want:
                    sys.exit(f"overlap_bench: mode {mode}: {results[(ranks, mode)][0][key]} {key}, expected {want}")
        for mode in modes:
            runs = results[(ranks, mode)]
            row = {"ranks": ranks, "mode": mode}
            for k in ("step_ms", "forward_ms", "backward_ms", "optimizer_ms", "waited_ms"):
                row[k] = statistics.median(r[k] for r in runs)
            row["waits_ms"] = {k: statistics.median(r["waits_ms"][k] for r in runs) for k in WAITS}
            row["buckets"] = runs[0]["buckets"]
            row["update_ms"] = statistics.median(r["update_ms"] for r in runs)
            row["groups_in_backward"] = runs[0]["groups_in_backward"]
            out.append(row)
    print(f"{'ranks':>5} {'mode':>7} {'ms/step':>8} {'fwd':>7} {'bwd':>7} {'opt':>6} {'waited':>7}  "
          "waited per step by kind (ms)")
    for r in out:
        w = r["waits_ms"]
        print(f"{r['ranks']:>5} {r['mode']:>7} {r['step_ms']:>8.1f} {r['forward_ms']:>7.1f} {r['backward_ms']:>7.1f} "
              f"{r['optimizer_ms']:>6.1f} {r['waited_ms']:>7.2f}  all-gathers {w['all_gathers']:.2f}, staging "
              f"{w['shard_staging']:.2f}, step updates {w['step_updates']:.2f}, reductions {w['reductions']:.2f}, "
              f"reduced-shard copies {w['reduced_shard_copies']:.2f}, reducer's thread {w['reducer_thread']:.2f}, pushes {w['working_shard_pushes']:.2f}, "
              f"NVMe {w['nvme']:.2f}")
        print(f"{'':>14}{r['buckets']}")
        if r["mode"] in ("on", "nonorm", "noclip", "early"):
            print(f"{'':>14}the pipelined update ran {r['update_ms']:.1f} ms per step beside the "
                  f"{'backward and the ' if r['mode'] == 'early' else ''}next forward")
        if r["mode"] == "early":
            print(f"{'':>14}{r['groups_in_backward']} groups' updates started during the backward over the run")
    print("losses: identical in off, comm, on and nonorm, and in noclip and early, among those run (checked)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
