"""``strata.utils``: DeepSpeed's ``deepspeed.utils`` calls on a parameter a Strata engine
manages (``safe_get_full_fp32_param`` and ``safe_set_full_fp32_param``), and
``strata.utils.zero_to_fp32``.

Each is a collective: every rank calls it with the same parameter (and value), at a step
boundary (before training or right after ``step()``). A parameter no engine manages gives
None, as DeepSpeed's does for a parameter outside ZeRO.

DeepSpeed's gradient and optimizer-state accessors (``safe_get_full_grad``,
``safe_get_full_optimizer_state`` and their ``set`` and ``local`` variants) are not here:
Strata reduces each gradient into the optimizer's partition as it arrives and keeps Adam's
moments in its tiers (possibly on NVMe) with no per-parameter view; calling them raises
NotImplementedError saying so (docs/deepspeed.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..zero import GatheredParameters, _engine_of

__all__ = ["safe_get_full_fp32_param", "safe_set_full_fp32_param"]


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """Collective: the parameter's fp32 master value, whole (on the CPU), or None when no
    engine manages it."""
    engine, _ = _engine_of(param)
    if engine is None:
        return None
    return engine._core.gather_parameters([param])[0]


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Collective: the parameter's master set to ``value`` (the same on every rank), through
    GatheredParameters with rank 0 as the modifier: exact in an fp32 run; in bf16 or fp16
    the value is rounded to the working dtype first (DeepSpeed's writes the fp32 master
    unrounded). Nothing when no engine manages it."""
    engine, _ = _engine_of(param)
    if engine is None:
        return
    with GatheredParameters([param], modifier_rank=0):
        # Whole on every rank here: the same answer everywhere (leaving by it drops nothing).
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(
                f"strata.utils.safe_set_full_fp32_param: value has shape {tuple(value.shape)}, the parameter "
                f"{tuple(param.shape)}"
            )
        if engine.rank == 0:
            with torch.no_grad():
                param.copy_(value.to(device=param.device, dtype=param.dtype))


def _not_here(name: str, what: str):
    def refused(*args, **kwargs):
        raise NotImplementedError(
            f"strata.utils.{name}: {what} (DeepSpeed's keeps a per-parameter view Strata does not): "
            f"Strata reduces each gradient into the optimizer's partition as it arrives and keeps Adam's "
            f"moments in its tiers; read the parameters with safe_get_full_fp32_param, the states "
            f"through a checkpoint (strata-ckpt)"
        )

    refused.__name__ = name
    return refused


for _name, _what in [("safe_get_full_grad", "the gradient"), ("safe_set_full_grad", "the gradient"),
                     ("safe_get_local_grad", "the gradient"), ("safe_set_local_grad", "the gradient"),
                     ("safe_get_full_optimizer_state", "the optimizer state"),
                     ("safe_set_full_optimizer_state", "the optimizer state"),
                     ("safe_get_local_optimizer_state", "the optimizer state"),
                     ("safe_set_local_optimizer_state", "the optimizer state"),
                     ("safe_get_local_fp32_param", "this rank's fragment"),
                     ("safe_set_local_fp32_param", "this rank's fragment")]:
    globals()[_name] = _not_here(_name, _what)
