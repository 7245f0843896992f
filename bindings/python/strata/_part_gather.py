"""strata.zero.Init's parts across ranks before strata.initialize, over torch.distributed (as
DeepSpeed's Init, which needs it initialized):

- rank 0's values: each parameter is broadcast from the data-parallel group's first rank as
  it is partitioned, so values a constructor sets differently per rank (an unseeded
  initialization, a rank-dependent fill) end as rank 0's, as with plain ``strata.initialize``;
- GatheredParameters on parts: DeepSpeed's "fill on rank 0" recipe (``with
  GatheredParameters(p, modifier_rank=0): if rank == 0: p.copy_(...)``) before any engine
  exists: the parts all-gathered into the whole parameter on every rank, the modifier's
  whole broadcast and cut into every rank's part on leaving (without a modifier, or leaving
  by an exception: dropped).

Without torch.distributed initialized, one process needs neither; several processes keep
their own values (build them the same on every rank: seed the generator) and cannot gather
parts before initialize (the error says what to call).
"""

from __future__ import annotations

from typing import List, Optional

import torch


def usable(world: int) -> bool:
    dist = torch.distributed
    return world > 1 and dist.is_available() and dist.is_initialized()


def _device_for(group, t: torch.Tensor) -> torch.Tensor:
    """``t`` where the group's backend can reach it (NCCL: a CUDA device)."""
    backend = str(torch.distributed.get_backend(group))
    if "nccl" in backend and t.device.type != "cuda":
        return t.to(f"cuda:{torch.cuda.current_device()}")
    return t


def _src(group, rank_in_group: int) -> int:
    return torch.distributed.get_global_rank(group, rank_in_group) if group is not None else rank_in_group


def broadcast_from(flat: torch.Tensor, group, rank_in_group: int = 0) -> None:
    """``flat`` (contiguous) set to the group's ``rank_in_group``'s values, in place."""
    moved = _device_for(group, flat)
    torch.distributed.broadcast(moved, _src(group, rank_in_group), group=group)
    if moved is not flat:
        flat.copy_(moved)


def all_gather_part(part, share) -> torch.Tensor:
    """The whole flat parameter from every rank's part (``share(numel, world, rank)`` gives
    each rank's (offset, count))."""
    counts = [share(part.numel, part.world, r)[1] for r in range(part.world)]
    widest = max(counts)
    mine = torch.zeros(widest, dtype=part.part.dtype, device=part.part.device)
    mine[: part.part.numel()] = part.part.reshape(-1)
    mine = _device_for(part.group, mine)
    pieces = [torch.empty_like(mine) for _ in range(part.world)]
    torch.distributed.all_gather(pieces, mine, group=part.group)
    return torch.cat([piece[:n] for piece, n in zip(pieces, counts)]).to(part.part.device)


class GatheredParts:
    """GatheredParameters' part for parameters strata.zero.Init partitioned and no engine
    holds yet (the module docstring). A collective when they span several ranks."""

    def __init__(self, params: List[torch.nn.Parameter], modifier_rank: Optional[int]):
        from .zero import partitioned

        self.items = [(p, partitioned(p)) for p in params]
        self.modifier = modifier_rank

    def __enter__(self):
        from .zero import _inside, _share

        for p, part in self.items:
            if part.open:
                raise RuntimeError(
                    "strata.zero.GatheredParameters: a parameter strata.zero.Init partitioned is being "
                    "initialized (its module's constructor or init function runs): gather it afterwards")
            if part.world > 1 and not usable(part.world):
                raise RuntimeError(
                    f"strata.zero.GatheredParameters: a parameter of shape {tuple(part.shape)} is partitioned over "
                    f"{part.world} ranks by strata.zero.Init and no engine holds it yet: gathering its parts needs "
                    f"torch.distributed initialized (strata.comm.init_distributed() before building the model), "
                    f"or gather it after strata.initialize"
                )
            if self.modifier is not None and self.modifier >= part.world:
                raise ValueError(
                    f"strata.zero.GatheredParameters: modifier_rank {self.modifier} is not a rank of the "
                    f"{part.world} the parameter is partitioned over")
        with torch.no_grad(), _inside():
            for p, part in self.items:
                whole = part.part.reshape(-1).clone() if part.world == 1 else all_gather_part(part, _share)
                part.open += 1  # its values are read whole now: the Init guards let them be
                p.data = whole.view(part.shape)
        return None

    def __exit__(self, exc_type, exc, tb) -> None:
        from .zero import _inside, _store

        with torch.no_grad(), _inside():
            for p, part in self.items:
                part.open -= 1
                flat = p.data.reshape(-1)
                if exc_type is None and self.modifier is not None:
                    if flat.numel() != part.numel:
                        raise RuntimeError(
                            f"strata.zero.GatheredParameters: a parameter changed shape inside the context "
                            f"({tuple(part.shape)} -> {tuple(p.data.shape)})")
                    if part.world > 1:
                        broadcast_from(flat, part.group, self.modifier)
                    _store(part, flat)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
