"""``strata.comm``: the few calls of ``deepspeed.comm`` that training scripts make, over
torch.distributed (the process group the engine reuses when it is initialized).

Before ``init_distributed()`` (or torch.distributed's own init) the queries answer from
torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``; one process without it) and
the collectives of a single process do nothing; a collective of several processes without a
process group is an error that says what to call.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["ReduceOp", "init_distributed", "is_initialized", "get_rank", "get_world_size", "get_local_rank",
           "barrier", "all_reduce", "broadcast", "all_gather"]

ReduceOp = dist.ReduceOp


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(dist_backend: Optional[str] = None, timeout: timedelta = timedelta(minutes=30),
                     init_method: Optional[str] = None, rank: int = -1, world_size: int = -1, **_ignored) -> None:
    """torch.distributed's process group from torchrun's environment (DeepSpeed's
    ``deepspeed.init_distributed``); nothing when one already exists. Backend: ``nccl`` when
    CUDA is usable, else ``gloo``. Without the environment (one process: a notebook), a
    process group of one over an in-memory store."""
    if is_initialized():
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if init_method is None and "MASTER_ADDR" not in os.environ and world_size in (-1, 1):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    kwargs = {}
    if rank >= 0:
        kwargs["rank"] = rank
    if world_size > 0:
        kwargs["world_size"] = world_size
    dist.init_process_group(backend, init_method=init_method or "env://", timeout=timeout, **kwargs)


def get_rank(group=None) -> int:
    if is_initialized():
        return dist.get_rank(group)
    return int(os.environ.get("RANK") or 0)


def get_world_size(group=None) -> int:
    if is_initialized():
        return dist.get_world_size(group)
    return int(os.environ.get("WORLD_SIZE") or 1)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK") or 0)


def _needs_group(what: str) -> bool:
    """True when a process group runs the collective; False for one process without one."""
    if is_initialized():
        return True
    if get_world_size() == 1:
        return False
    raise RuntimeError(
        f"strata.comm.{what}: {get_world_size()} processes but no process group: call "
        f"strata.comm.init_distributed() (or torch.distributed.init_process_group) first"
    )


def barrier(group=None) -> None:
    if _needs_group("barrier"):
        dist.barrier(group)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False):
    if _needs_group("all_reduce"):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return None


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False):
    if _needs_group("broadcast"):
        return dist.broadcast(tensor, src, group=group, async_op=async_op)
    return None


def all_gather(tensor_list, tensor: torch.Tensor, group=None, async_op: bool = False):
    if _needs_group("all_gather"):
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    tensor_list[0].copy_(tensor)
    return None
