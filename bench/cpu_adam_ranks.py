#!/usr/bin/env python3
"""cpu_adam_ranks: several ranks of one machine stepping CPU-Adam at once, each with the
threads the engine gives it (strata.cpu_adam_threads 0: its share of the cores) against
every rank taking every core (what each rank took before, and what a rank's CPU-Adam takes
when nothing divides the cores).

    python bench/cpu_adam_ranks.py [--ranks 2] [--params 33554432] [--steps 8]
        [--rounds 3] [--threads share,all] [--json FILE]

Each rank is a process (as torchrun starts them, with the same affinity mask) holding
--params fp32 parameters with gradients and a strata.optim.CPUAdam (AdamW); the ranks
wait for each other before every step, as the ranks of a job reach their step together.
A step of the job ends when its slowest rank's ends: reported per setting as the median
over the timed steps of the slowest rank's time, and the bandwidth that implies (Adam
fp32 moves 28 bytes a parameter: p, g, m, v read, p, m, v written) summed over the
ranks. The settings run in turn --rounds times (a noisy machine's drift falls on each
alike); the last line gives each one's median over the rounds.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time


def rank_main(rank, threads, params, steps, barrier, out):
    import torch

    import strata

    torch.manual_seed(rank)
    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params)
    opt = strata.optim.CPUAdam([p], lr=1e-4, weight_decay=0.01, num_threads=threads)
    opt.step()  # the states are allocated and touched
    times = []
    for _ in range(steps):
        barrier.wait()
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    out.put((rank, opt.isa, times))


def run(args, threads):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(args.ranks)
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, threads, args.params, args.steps, barrier, out))
             for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    got = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a rank exited with {proc.exitcode}")
    got.sort()
    slowest = [max(g[2][k] for g in got) for k in range(args.steps)]
    step_s = statistics.median(slowest)
    return {"threads": threads, "isa": got[0][1], "step_s": step_s,
            "gb_per_s": 28 * args.params * args.ranks / step_s / 1e9}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--params", type=int, default=1 << 25, help="fp32 parameters per rank")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="share,all",
                    help="comma-separated: share (cores / ranks, the engine's default), all (every core), or N")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    if args.ranks < 1 or args.params < 1 or args.steps < 1 or args.rounds < 1:
        ap.error("--ranks, --params, --steps and --rounds must be at least 1")
    cores = len(os.sched_getaffinity(0))
    settings = []
    for s in args.threads.split(","):
        s = s.strip()
        if s == "share":
            settings.append(("share", max(1, cores // args.ranks)))
        elif s == "all":
            settings.append(("all", cores))
        elif s.isdigit() and int(s) > 0:
            settings.append((s, int(s)))
        else:
            ap.error(f"--threads {s!r}: expected share, all or a positive number")
    print(f"cpu_adam_ranks: {args.ranks} ranks x {args.params / 1e6:.1f}M fp32 parameters, {cores} cores "
          f"this process may use; {args.steps} steps per run, medians of the slowest rank", flush=True)
    results = []
    for rnd in range(args.rounds):
        for name, threads in settings:
            r = run(args, threads)
            r.update(setting=name, round=rnd)
            results.append(r)
            print(f"  round {rnd + 1}: {name} ({threads} threads per rank, {r['isa']}): "
                  f"{r['step_s'] * 1e3:.1f} ms/step, {r['gb_per_s']:.1f} GB/s over the ranks", flush=True)
    print(f"medians over {args.rounds} rounds (ms/step):", flush=True)
    for name, threads in settings:
        mine = [r["step_s"] for r in results if r["setting"] == name]
        print(f"  {name} ({threads} threads per rank): {statistics.median(mine) * 1e3:.1f} "
              f"({', '.join(f'{x * 1e3:.1f}' for x in mine)})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": args.ranks, "params": args.params, "cores": cores, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
