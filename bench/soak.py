#!/usr/bin/env python3
"""soak: strata-train for 2,000 steps with the optimizer states and the parameters on NVMe
and a checkpoint every 200 steps, watching what the process holds.

    python3 bench/soak.py [--steps 2000] [--save-every 200] [--every 100] [--model small]
        [--dir DIR] [--keep] [--json FILE] [--strata-train build/bin/strata-train]

strata-train's embedded default configuration (`--print-config`) with both offload devices
set to nvme under DIR/swap (offload_param.max_in_cpu 0: every working shard on NVMe) trains
the model on the project's own documentation; `--resources-every` makes it print, at the
step boundary, its resident memory (VmRSS), open file descriptors, locked (VmLck: the
pinned host tier) and kernel-pinned (VmPin) bytes, and the allocated bytes of its open swap
files. Flat means: resident memory at the last step within 2% of that at step 200 (after
the first save), and the descriptors, locked, pinned and swap bytes at every sample from
step 200 on equal to step 200's. Prints the samples and the verdict; exit status 1 when
something is not flat or the run failed. DIR defaults to a fresh directory under /tmp
(removed unless --keep): put it on the drive the swap tier would use.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

LINE = re.compile(
    r"strata-train: resources at step (\d+): rss (\d+) B, open fds (\d+), locked (\d+) B, "
    r"pinned (\d+) B, swap files (\d+) B, host tier (\d+) B")
KEYS = ("rss", "fds", "locked", "pinned", "swap", "host_tier")


def mib(b):
    return f"{b / 2**20:.2f} MiB"


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--every", type=int, default=100, help="sample every N steps (default 100)")
    ap.add_argument("--model", default="small", help="strata-train preset (default small)")
    ap.add_argument("--dir", help="where the swap files and checkpoints go (default: a new /tmp dir)")
    ap.add_argument("--keep", action="store_true", help="keep --dir's contents afterwards")
    ap.add_argument("--json", help="also write the samples and the verdict here")
    ap.add_argument("--strata-train", default=os.path.join(root, "build", "bin", "strata-train"))
    args = ap.parse_args(argv)
    if args.steps < 2 * args.save_every or args.save_every % args.every:
        ap.error("--steps must cover two saves and --save-every must be a multiple of --every")
    if not os.access(args.strata_train, os.X_OK):
        ap.error(f"{args.strata_train} is not an executable: build the project first")
    made = args.dir is None
    work = args.dir or tempfile.mkdtemp(prefix="strata-soak-")
    swap, ckpt = os.path.join(work, "swap"), os.path.join(work, "ckpt")
    os.makedirs(swap, exist_ok=True)
    try:
        p = subprocess.run([args.strata_train, "--model", args.model, "--print-config"], capture_output=True,
                           text=True, check=True)
        cfg = json.loads(p.stdout)
        z = cfg["zero_optimization"]
        z["offload_optimizer"].update(device="nvme", nvme_path=[swap])
        z["offload_param"].update(device="nvme", nvme_path=[swap], max_in_cpu=0)
        cfg_path = os.path.join(work, "soak.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=1)
        cmd = [args.strata_train, "--config", cfg_path, "--model", args.model, "--steps", str(args.steps),
               "--save-dir", ckpt, "--save-every", str(args.save_every), "--resources-every", str(args.every),
               "--no-progress"]
        print("soak: " + " ".join(cmd), flush=True)
        t0 = time.time()
        run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.time() - t0
        samples = {}
        for line in run.stdout.splitlines():
            m = LINE.search(line)
            if m:
                v = [int(x) for x in m.groups()]
                samples[v[0]] = dict(zip(KEYS, v[1:]))
        saves = sum(1 for line in run.stdout.splitlines() if "strata-train: saved " in line)
        summary = [line for line in run.stdout.splitlines() if "strata-train: summary:" in line]
        if run.returncode != 0:
            print(run.stdout[-3000:])
            print(f"soak: strata-train failed (exit {run.returncode})")
            return 1
        print(f"{'step':>6} {'rss':>12} {'fds':>4} {'locked':>12} {'pinned':>10} {'swap files':>12} {'host tier':>12}")
        for step in sorted(samples):
            s = samples[step]
            print(f"{step:>6} {mib(s['rss']):>12} {s['fds']:>4} {mib(s['locked']):>12} {mib(s['pinned']):>10} "
                  f"{mib(s['swap']):>12} {mib(s['host_tier']):>12}")
        first, last = args.save_every, args.steps
        verdict = {}
        if first in samples and last in samples:
            a, b = samples[first], samples[last]
            later = [samples[k] for k in sorted(samples) if k >= first]
            verdict["rss_change"] = b["rss"] / a["rss"] - 1
            verdict["rss_flat"] = abs(verdict["rss_change"]) <= 0.02
            for k in ("fds", "locked", "pinned", "swap"):
                verdict[f"{k}_flat"] = all(s[k] == a[k] for s in later)
        ok = bool(verdict) and all(v for k, v in verdict.items() if k.endswith("_flat"))
        print(f"soak: {args.steps} steps in {wall:.0f} s, {saves} checkpoints saved; {summary[0] if summary else ''}")
        if verdict:
            print(f"soak: rss at step {last} vs {first}: {verdict['rss_change'] * 100:+.2f}% "
                  f"({'flat' if verdict['rss_flat'] else 'NOT flat'}: within 2%); fds, locked, pinned, swap bytes "
                  "equal at every sample from step " + str(first) + ": " +
                  ", ".join(f"{k} {'yes' if verdict[k + '_flat'] else 'NO'}" for k in ("fds", "locked", "pinned", "swap")))
        print(f"soak: {'FLAT' if ok else 'NOT FLAT'}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"command": cmd, "wall_s": wall, "saves": saves, "samples": samples, "verdict": verdict,
                           "flat": ok}, f, indent=1)
        return 0 if ok else 1
    finally:
        if not args.keep:
            if made:
                shutil.rmtree(work, ignore_errors=True)
            else:
                shutil.rmtree(swap, ignore_errors=True)
                shutil.rmtree(ckpt, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
