"""Activation checkpointing configured by the config, as ``deepspeed.checkpointing`` is.

``strata.checkpointing.checkpoint(function, *args)`` runs ``function(*args)`` through
torch.utils.checkpoint's reentrant checkpoint: the activations are recomputed in the
backward (Strata gathers the blocks again there, docs/python.md). With the config's
``activation_checkpointing.cpu_checkpointing`` true (set by the last ``strata.initialize``,
or by ``configure``), the saved inputs of a checkpoint live in host memory between the
forward and the backward (pinned when a GPU is present), as DeepSpeed's
``cpu_checkpointing`` does: ``torch.autograd.graph.save_on_cpu`` around the checkpoint.

torch.utils.checkpoint itself works with Strata blocks too; it knows nothing of the config.
The other keys of DeepSpeed's section are refused by the config (docs/config.md) and by
``configure``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional, Union

import torch
import torch.utils.checkpoint

_cpu_checkpointing = False


def _section(config: Union[Mapping[str, Any], str, os.PathLike, None]) -> Mapping[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        doc = config
    else:
        text = os.fspath(config)
        if os.path.exists(text):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        doc = json.loads(text)
    section = doc.get("activation_checkpointing") or {}
    if not isinstance(section, Mapping):
        raise ValueError("strata.checkpointing: activation_checkpointing must be an object")
    return section


def configure(
    mpu_: Any = None,
    deepspeed_config: Union[Mapping[str, Any], str, os.PathLike, None] = None,
    partition_activations: Optional[bool] = None,
    contiguous_checkpointing: Optional[bool] = None,
    num_checkpoints: Optional[int] = None,
    checkpoint_in_cpu: Optional[bool] = None,
    synchronize: Optional[bool] = None,
    profile: Optional[bool] = None,
) -> None:
    """DeepSpeed's ``deepspeed.checkpointing.configure``: ``checkpoint_in_cpu`` (or the
    config's ``cpu_checkpointing``) is honoured; the settings of DeepSpeed's own checkpoint
    function are refused when set."""
    global _cpu_checkpointing
    section = _section(deepspeed_config)
    refused = {
        "partition_activations": partition_activations if partition_activations is not None
        else section.get("partition_activations"),
        "contiguous_checkpointing": contiguous_checkpointing if contiguous_checkpointing is not None
        else section.get("contiguous_memory_optimization"),
        "synchronize": synchronize if synchronize is not None else section.get("synchronize_checkpoint_boundary"),
        "profile": profile if profile is not None else section.get("profile"),
    }
    on = [name for name, value in refused.items() if value]
    if on:
        raise NotImplementedError(
            f"strata.checkpointing.configure: {', '.join(on)} belong(s) to DeepSpeed's own checkpoint "
            "function, which Strata does not have; only checkpoint_in_cpu (cpu_checkpointing) is supported"
        )
    del mpu_, num_checkpoints  # no partitioned activations: the model-parallel group is not needed
    if checkpoint_in_cpu is None:
        checkpoint_in_cpu = bool(section.get("cpu_checkpointing", False))
    _cpu_checkpointing = bool(checkpoint_in_cpu)


def _from_engine_config(cfg: Mapping[str, Any]) -> None:
    """strata.initialize's call: the validated config's section (the config already refused
    every key but cpu_checkpointing)."""
    global _cpu_checkpointing
    _cpu_checkpointing = bool(_section(cfg).get("cpu_checkpointing", False))


def cpu_checkpointing() -> bool:
    """Whether checkpoint() keeps the saved inputs in host memory."""
    return _cpu_checkpointing


def checkpoint(function, *args):
    """``function(*args)`` with its activations recomputed in the backward; the saved inputs
    in host memory when cpu_checkpointing is on. A dummy input that requires grad makes the
    reentrant checkpoint record its node even when no argument requires grad, so the
    block's parameters still get their gradients."""
    if not torch.is_grad_enabled():
        return function(*args)
    dummy = torch.empty(0, requires_grad=True)

    def run(_dummy, *inner):
        return function(*inner)

    if _cpu_checkpointing:
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return torch.utils.checkpoint.checkpoint(run, dummy, *args, use_reentrant=True)
    return torch.utils.checkpoint.checkpoint(run, dummy, *args, use_reentrant=True)
