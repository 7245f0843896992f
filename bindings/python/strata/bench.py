"""strata.nvme_bench: the swap-tier sizing sweep of tools/nvme_bench, from Python."""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional, Sequence, Union

from . import _strata

__all__ = ["nvme_bench"]

Size = Union[int, str]


def _size(v: Size) -> int:
    return _strata.parse_bytes(v) if isinstance(v, str) else int(v)


def nvme_bench(
    path: Union[None, str, os.PathLike, Sequence[Union[str, os.PathLike]]] = None,
    size: Optional[Size] = None,
    block_sizes: Optional[Iterable[Size]] = None,
    queue_depths: Optional[Iterable[int]] = None,
    threads: Optional[Iterable[int]] = None,
    modes: Optional[Iterable[str]] = None,
    direct: bool = True,
    memory: str = "hugepage",
    engine: str = "auto",
    seconds: Optional[float] = None,
    rounds: Optional[int] = None,
    quick: bool = False,
) -> dict:
    """Measures read/write bandwidth of the directories the swap tier would use.

    ``path``: a directory or a list of them (one per drive; default: the current
    directory). ``size`` (bytes or "64MiB"), ``block_sizes`` (multiples of 4096),
    ``queue_depths``, ``threads`` and ``modes`` ("read", "write") span the sweep;
    ``direct``: O_DIRECT (refused with ValueError where the filesystem cannot) or the page
    cache; ``memory``: "hugepage", "pinned" or "plain" I/O buffers; ``engine``: "auto",
    "io_uring" or "sync"; ``seconds`` per point and ``rounds`` per point. ``quick=True``
    starts from nvme_bench's ``--quick`` settings (64 MiB, 128K and 1M blocks, queue depths
    4 and 16, one thread, 0.2 s per point) and any argument given overrides them.

    Returns a dict: ``points`` (one dict per measurement with mode, block_size,
    queue_depth, threads, memory, gbps, iops, p50_us, p99_us and more), ``best_read``
    and ``best_write`` (the fastest point of each mode, or None), ``chosen`` (the setting
    for the config's aio section), ``config`` (the snippet to merge into a DeepSpeed
    config), ``report`` (the text nvme_bench prints), ``report_json`` and the machine,
    memory and engine notes.
    """
    if path is None:
        paths: list = []
    elif isinstance(path, (str, os.PathLike)):
        paths = [os.fspath(path)]
    else:
        paths = [os.fspath(p) for p in path]
    out = _strata.nvme_bench(
        paths,
        None if size is None else _size(size),
        None if block_sizes is None else [_size(b) for b in block_sizes],
        None if queue_depths is None else [int(q) for q in queue_depths],
        None if threads is None else [int(t) for t in threads],
        None if modes is None else [str(m) for m in modes],
        bool(direct),
        memory,
        engine,
        None if seconds is None else float(seconds),
        None if rounds is None else int(rounds),
        bool(quick),
    )
    out["config"] = json.loads(out.pop("config_json"))
    out["report_json"] = json.loads(out["report_json"])
    return out
