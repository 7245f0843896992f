"""Async file I/O beside DeepSpeed's aio handle, in one process, on the same file.

DeepSpeed's ``aio_handle`` (DeepNVMe: libaio, O_DIRECT, its own threads) and Strata's
``strata.io.AioHandle`` (the swap tier's engine: io_uring, O_DIRECT) each write and read
one file of --size bytes from and into a page-locked, 4 KiB-aligned tensor, with the same
block size, queue depth and thread count. Rounds are interleaved (DeepSpeed write, Strata
write, DeepSpeed read, Strata read, ...) so a shared machine's drift hits both alike; each
operation is timed from submission to the end of wait(), and the median GB/s (10^9 B/s)
of the rounds is reported. Every read is checked against the written bytes.

The file lives in --dir (a directory on the drive to measure, never tmpfs: O_DIRECT).
Both handles get a file of their own in it, written once before the timed rounds.

usage: .venv/bin/python bench/peers/io_peers.py --dir DIR [--size 1GiB] [--block-size 1MiB]
       [--queue-depth 16] [--threads 1] [--rounds 5]
(needs bench/peers/install.sh and Debian's libaio-dev; DeepSpeed builds its aio op on first use)
"""

import argparse
import os
import statistics
import sys
import time


def parse_bytes(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "": 1}
    for unit, mult in units.items():
        if unit and text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="directory on the drive to measure")
    ap.add_argument("--size", default="1GiB", help="bytes per file (default 1GiB)")
    ap.add_argument("--block-size", default="1MiB", help="bytes per request (default 1MiB)")
    ap.add_argument("--queue-depth", type=int, default=16, help="requests in flight (default 16)")
    ap.add_argument("--threads", type=int, default=1, help="I/O threads / rings (default 1)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    args = ap.parse_args()
    size, block = parse_bytes(args.size), parse_bytes(args.block_size)
    if size % 4096 or block % 4096 or size < block:
        sys.exit("io_peers: --size and --block-size must be multiples of 4 KiB, size >= block")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch

    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
    except ImportError as e:
        sys.exit(f"io_peers: DeepSpeed is not installed ({e}); run bench/peers/install.sh")
    import strata.io

    builder = AsyncIOBuilder()
    if not builder.is_compatible(verbose=True):
        sys.exit("io_peers: DeepSpeed's async_io op cannot be built here (libaio-dev missing?)")
    aio = builder.load(verbose=False)
    ds = aio.aio_handle(block, args.queue_depth, False, True, args.threads)
    st = strata.io.AioHandle(block_size=block, queue_depth=args.queue_depth, threads=args.threads)

    n = size // 4
    src = strata.io.empty_aligned(n, torch.float32)
    src.copy_(torch.rand(n, generator=torch.Generator().manual_seed(0)))
    dst = strata.io.empty_aligned(n, torch.float32)
    files = {name: os.path.join(args.dir, f"io_peers.{name}.{os.getpid()}") for name in ("ds", "st")}

    # Both handles have the same async_pwrite / async_pread / wait calls.
    def io(handle, op, path):
        def run():
            if op == "write":
                handle.async_pwrite(src, path)
            else:
                handle.async_pread(dst, path)
            return handle.wait()

        return run

    handles = [("DeepSpeed aio_handle", ds, files["ds"]), ("Strata AioHandle", st, files["st"])]
    ops = [(who, op, io(h, op, path)) for op in ("write", "read") for who, h, path in handles]
    times = {(who, op): [] for who, op, _ in ops}
    try:
        for _, _, write in ops[:2]:
            write()
        for r in range(args.rounds + 1):
            for who, op, fn in ops:
                if op == "read":
                    dst.zero_()
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
                if op == "read" and not torch.equal(dst, src):
                    sys.exit(f"io_peers: {who} read back different bytes (round {r})")
                if r > 0:  # round 0 warms up
                    times[(who, op)].append(t)
    finally:
        for f in files.values():
            if os.path.exists(f):
                os.unlink(f)

    print(f"io_peers: {args.dir}, {size >> 20} MiB per file, block {block >> 10} KiB, queue depth "
          f"{args.queue_depth}, {args.threads} thread(s), {args.rounds} rounds (median; every read "
          f"verified); strata engine {st.engine}")
    print(f"{'handle':<22} {'op':<6} {'GB/s':>7}   rounds (GB/s)")
    gbps = {}
    for (who, op), ts in times.items():
        rates = [size / t / 1e9 for t in ts]
        gbps[(who, op)] = statistics.median(rates)
        print(f"{who:<22} {op:<6} {gbps[(who, op)]:>7.3f}   " + ", ".join(f"{x:.3f}" for x in rates))
    for op in ("write", "read"):
        ratio = gbps[("Strata AioHandle", op)] / gbps[("DeepSpeed aio_handle", op)]
        print(f"Strata / DeepSpeed {op}: {ratio:.2f}x")


if __name__ == "__main__":
    main()
