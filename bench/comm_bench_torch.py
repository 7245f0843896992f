#!/usr/bin/env python3
"""The peer of bin/comm_bench: torch.distributed's collectives, measured the same way.

    .venv/bin/torchrun --nproc_per_node 2 bench/comm_bench_torch.py \
        --backend gloo --min-bytes 1KiB --max-bytes 64MiB

For every collective and size (doubling from --min-bytes to --max-bytes): --warmup untimed
and --iters timed operations, a barrier (untimed) before each; time = median over the
iterations on each rank, then the maximum over ranks; algbw = full-buffer bytes / time;
busbw = algbw * (W-1)/W (all_gather, reduce_scatter) or * 2(W-1)/W (all_reduce), as
nccl-tests and comm_bench define them. all_gather is the list form (dist.all_gather into W
tensors; the single-tensor all_gather_into_tensor is measured too, and reported when a
process group does not support it). reduce_scatter (list form) is reported as not
supported when the process group lacks it (torch 1.13's Gloo did; 2.11's has it). Results are checked once per size (untimed). Rank 0 prints the tables.
"""
import argparse
import os
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

UNITS = {"": 1, "b": 1, "k": 1024, "kib": 1024, "kb": 1000, "m": 1024**2, "mib": 1024**2,
         "mb": 1000**2, "g": 1024**3, "gib": 1024**3, "gb": 1000**3}


def parse_bytes(text):
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def fmt_bytes(n):
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "int64": torch.int64}


def partition(total, world, rank):
    base, extra = divmod(total, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def time_op(fn, iters, warmup, prepare=None):
    """prepare() runs untimed before the barrier of every iteration (as comm_bench --check
    restores all_reduce's input and poisons the outputs)."""
    times = []
    for it in range(warmup + iters):
        if prepare is not None:
            prepare()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if it >= warmup:
            times.append((t1 - t0) * 1e6)
    return statistics.median(times), min(times)


def slowest(value):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="gloo")
    p.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1KiB"))
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64MiB"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--ops", default="all_gather,all_gather_into_tensor,reduce_scatter,all_reduce")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    w, r = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype]
    es = torch.tensor([], dtype=dtype).element_size()
    leader = r == 0
    if leader:
        print(f"comm_bench_torch: torch {torch.__version__}, {args.backend}, world size {w}, "
              f"dtype {args.dtype}, sizes {fmt_bytes(args.min_bytes)}..{fmt_bytes(args.max_bytes)},"
              f" iters {args.iters}, warmup {args.warmup}", flush=True)
    failures = 0
    for op in args.ops.split(","):
        factor = (w - 1) / w * (2 if op == "all_reduce" else 1)
        if leader:
            print(f"\n{op} (torch.distributed {args.backend}, {args.dtype}, {w} ranks)", flush=True)
            print(f"{'size':>10} {'count':>11} {'time(us)':>11} {'min(us)':>11} "
                  f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}  check", flush=True)
        size = args.min_bytes
        while size <= args.max_bytes:
            n = max(1, size // es)
            nbytes = n * es
            try:
                if op == "all_reduce":
                    base = ((torch.arange(n) * 3 + r * 5) % 17 - 8).to(dtype)
                    data = base.clone()
                    med, mn = time_op(lambda: dist.all_reduce(data), args.iters, args.warmup,
                                      prepare=lambda: data.copy_(base))
                    want = sum(((torch.arange(n) * 3 + q * 5) % 17 - 8) for q in range(w)).to(dtype)
                    ok = torch.equal(data, want)
                elif op == "all_gather":
                    cnt = n // w  # the list form needs equal sizes: W * (n // W) elements
                    n = cnt * w
                    nbytes = n * es
                    if cnt == 0:
                        size *= 2
                        continue
                    shard = ((torch.arange(cnt) + r * cnt) * 7 % 241 - 120).to(dtype)
                    outs = [torch.empty(cnt, dtype=dtype) for _ in range(w)]
                    med, mn = time_op(lambda: dist.all_gather(outs, shard), args.iters,
                                      args.warmup, prepare=lambda: [o.fill_(-1) for o in outs])
                    want = ((torch.arange(n) * 7) % 241 - 120).to(dtype)
                    ok = torch.equal(torch.cat(outs), want)
                elif op == "all_gather_into_tensor":
                    cnt = n // w
                    n = cnt * w
                    nbytes = n * es
                    if cnt == 0:
                        size *= 2
                        continue
                    gather = getattr(dist, "all_gather_into_tensor", None) or dist._all_gather_base
                    shard = ((torch.arange(cnt) + r * cnt) * 7 % 241 - 120).to(dtype)
                    out = torch.empty(n, dtype=dtype)
                    med, mn = time_op(lambda: gather(out, shard), args.iters, args.warmup,
                                      prepare=lambda: out.fill_(-1))
                    ok = torch.equal(out, ((torch.arange(n) * 7) % 241 - 120).to(dtype))
                elif op == "reduce_scatter":
                    cnt = n // w
                    n = cnt * w
                    nbytes = n * es
                    full = [((torch.arange(cnt) * 3 + r * 5) % 17 - 8).to(dtype) for _ in range(w)]
                    out = torch.empty(cnt, dtype=dtype)
                    med, mn = time_op(lambda: dist.reduce_scatter(out, full), args.iters,
                                      args.warmup, prepare=lambda: out.fill_(-1))
                    want = sum(((torch.arange(cnt) * 3 + q * 5) % 17 - 8) for q in range(w))
                    ok = torch.equal(out, want.to(dtype))
                else:
                    raise SystemExit(f"unknown op {op}")
            except (RuntimeError, NotImplementedError, AttributeError) as e:
                if leader:
                    print(f"  {op}: not supported by torch.distributed's {args.backend} process "
                          f"group in torch {torch.__version__}: {str(e).splitlines()[0]}",
                          flush=True)
                break
            med, mn = slowest(med), slowest(mn)
            bad = torch.tensor([0 if ok else 1])
            dist.all_reduce(bad)
            failures += int(bad.item())
            status = "ok" if bad.item() == 0 else "FAILED"
            algbw = nbytes / (med * 1e-6)
            if leader:
                print(f"{fmt_bytes(nbytes):>10} {n:>11} {med:>11.1f} {mn:>11.1f} "
                      f"{algbw / 1e9:>12.3f} {algbw * factor / 1e9:>12.3f}  {status}", flush=True)
            size *= 2
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
