#!/usr/bin/env python3
"""gemm_peak: the machine's measured matrix-multiply peak, the denominator of model FLOPs
utilization (MFU) on a CPU.

    .venv/bin/python bench/gemm_peak.py [--device cpu|cuda] [--dtype fp32|bf16|fp16]
        [--sizes 512,1024,2048,4096] [--seconds 1.0] [--threads N] [--json FILE]

Times torch.mm of square n x n matrices (2 n^3 FLOPs each) with the LibTorch build the
project uses (the venv's; strata-train links the same libraries), each size for about
--seconds after a warm-up, and reports each size's TFLOPS and the best: the peak this
machine sustains on dense GEMM with --threads threads (default: torch's, all cores).
strata-train --peak-tflops and bench/train_bench.py --peak-tflops take it; on a GPU the
datasheet's dense peak (strata.datasheet_peak_flops) is the usual denominator and this
program's figure shows how far below it a real GEMM runs.
"""

import argparse
import json
import sys
import time

import torch


def measure(n, dtype, device, seconds):
    """TFLOPS of n x n x n matrix products, timed over about `seconds`."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    c = torch.empty(n, n, dtype=dtype, device=device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.mm(a, b, out=c)  # warm-up (the library's first call picks its kernels)
    sync()
    reps = 0
    t0 = time.perf_counter()
    while True:
        torch.mm(a, b, out=c)
        reps += 1
        if reps % 4 == 0:
            sync()
            if time.perf_counter() - t0 >= seconds:
                break
    sync()
    elapsed = time.perf_counter() - t0
    return 2.0 * n**3 * reps / elapsed / 1e12


def measure_peak(device="cpu", dtype="fp32", sizes=(512, 1024, 2048, 4096), seconds=1.0):
    """{"tflops": best, "n": its size, "by_size": {n: tflops}} on `device` in `dtype`."""
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    dev = torch.device(device)
    by_size = {n: measure(n, dt, dev, seconds) for n in sizes}
    n = max(by_size, key=by_size.get)
    return {"tflops": by_size[n], "n": n, "by_size": by_size}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    ap.add_argument("--sizes", default="512,1024,2048,4096")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    r = measure_peak(args.device, args.dtype, sizes, args.seconds)
    for n, t in r["by_size"].items():
        print(f"gemm_peak: {args.dtype} {n} x {n} x {n}: {t:.3f} TFLOPS")
    print(f"gemm_peak: peak {r['tflops']:.3f} TFLOPS ({args.dtype}, n = {r['n']}, {where}, torch {torch.__version__})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "device": where, **r}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
