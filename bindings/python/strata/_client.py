"""A client optimizer and learning-rate scheduler (DeepSpeed's ``initialize(optimizer=...,
lr_scheduler=...)``) on the engine's CPU Adam.

An Adam or AdamW the script made (torch's, ``strata.optim.CPUAdam``, DeepSpeed's
``DeepSpeedCPUAdam`` or ``FusedAdam``), or a callable that makes one from the parameters,
becomes the config's optimizer section and the parameter groups, with the same
hyper-parameters; its own ``step`` is never called (the engine updates its partitions).
Another optimizer class is refused, naming it. A scheduler (a torch LRScheduler built on that
optimizer, or a callable that makes one from it) drives the engine's learning rate: before
every step the engine takes the rate from the optimizer's parameter groups, and after every
applied step it calls ``scheduler.step()``, as DeepSpeed's does; its state is kept in the
checkpoints.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, List, Optional, Tuple

import torch

from ._optimizer import group_factor

_ADAM_NAMES = ("Adam", "AdamW", "CPUAdam", "DeepSpeedCPUAdam", "FusedAdam")


def _decoupled(opt) -> bool:
    """Whether ``opt`` applies decoupled weight decay (AdamW) rather than L2 (Adam)."""
    name = type(opt).__name__
    if isinstance(opt, torch.optim.AdamW) or name == "AdamW":
        return True
    if isinstance(opt, torch.optim.Adam) or name == "Adam":
        return bool(opt.defaults.get("decoupled_weight_decay", False))
    for attr in ("adamw_mode", "adam_w_mode"):  # strata.optim.CPUAdam; DeepSpeed's
        if hasattr(opt, attr):
            return bool(getattr(opt, attr))
        if attr in opt.defaults:
            return bool(opt.defaults[attr])
    return True


def _check_class(opt) -> None:
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"strata.initialize: optimizer must be a torch.optim.Optimizer or a callable that makes one from "
            f"the parameters, got {type(opt).__name__}"
        )
    if type(opt).__name__ not in _ADAM_NAMES:
        raise NotImplementedError(
            f"strata.initialize: the client optimizer {type(opt).__module__}.{type(opt).__name__} cannot run on "
            f"Strata's partitions: the engine updates them with its CPU Adam, so Adam and AdamW (torch's, "
            f"strata.optim.CPUAdam, DeepSpeed's DeepSpeedCPUAdam and FusedAdam) are taken with their "
            f"hyper-parameters; use one of them, or the config's optimizer section (Adam, AdamW, Lamb)"
        )
    for key in ("amsgrad", "maximize"):
        if any(g.get(key) for g in opt.param_groups):
            raise NotImplementedError(
                f"strata.initialize: the client optimizer has {key}=True, which Strata's CPU Adam does not "
                f"implement; leave it False"
            )


def optimizer_from_client(client, params: List[torch.nn.Parameter], cfg: dict) -> Tuple[Any, List[dict]]:
    """(the optimizer instance, torch.optim-style groups for strata.initialize) from
    ``client`` (an optimizer or a callable making one from ``params``); ``cfg``'s optimizer
    section is replaced by the optimizer's (a section already there is dropped, with a log
    line, as DeepSpeed uses the client's)."""
    opt = client if isinstance(client, torch.optim.Optimizer) else client(params) if callable(client) else client
    _check_class(opt)
    first = opt.param_groups[0]
    section = {
        "type": "AdamW" if _decoupled(opt) else "Adam",
        "params": {"lr": float(first["lr"]), "betas": [float(b) for b in first["betas"]],
                   "eps": float(first["eps"]), "weight_decay": float(first["weight_decay"]),
                   "bias_correction": bool(first.get("bias_correction", True))},
    }
    if section["type"] == "Adam":
        section["params"]["adam_w_mode"] = False  # torch's Adam: L2 (DeepSpeed's default differs)
    if cfg.get("optimizer"):
        logging.getLogger("strata").info(
            "strata.initialize: the client optimizer %s is used; the config's optimizer section is left out",
            type(opt).__name__)
    cfg["optimizer"] = section
    groups = [{"params": list(g["params"]), "lr": float(g["lr"]), "betas": tuple(float(b) for b in g["betas"]),
               "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])} for g in opt.param_groups]
    return opt, groups


class _LrHolder(torch.optim.Optimizer):
    """What a scheduler callable is given when the optimizer is the config's: one parameter
    group per engine group, holding only its learning rate (the engine follows it)."""

    def __init__(self, lrs: List[float]):
        super().__init__([{"params": [torch.zeros(1)], "lr": lr} for lr in lrs], {})

    def step(self, closure=None):
        raise RuntimeError("strata: the engine applies the optimizer; call engine.step()")


class ClientSchedule:
    """The engine's learning rate from a client scheduler (the module docstring)."""

    def __init__(self, scheduler, source: torch.optim.Optimizer, factors: List[float]):
        self.scheduler = scheduler
        self.source = source  # the optimizer whose groups' lr the scheduler sets
        self.factors = factors  # each engine group's lr over the base rate

    def base_lr(self) -> float:
        lrs = [float(g["lr"]) for g in self.source.param_groups]
        if len(lrs) != len(self.factors):
            raise ValueError(
                f"strata: the client scheduler's optimizer has {len(lrs)} parameter groups, the engine "
                f"{len(self.factors)}; build the scheduler on the optimizer given to strata.initialize"
            )
        base = lrs[0] / self.factors[0] if self.factors[0] > 0 else 0.0
        for k, (lr, f) in enumerate(zip(lrs, self.factors)):
            if abs(lr - base * f) > 1e-6 * max(abs(lr), 1e-12):
                raise NotImplementedError(
                    f"strata: the client scheduler set parameter group {k}'s lr to {lr}, not {f:g} x group 0's "
                    f"({lrs[0]}) as at the start: the engine scales one rate by each group's fixed factor, "
                    f"so per-group schedules are not supported"
                )
        return base

    def after_applied_step(self) -> None:
        with warnings.catch_warnings():
            # torch's check that optimizer.step() ran first: the engine applied the step.
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state)
        last = getattr(self.scheduler, "get_last_lr", None)
        if last is not None:  # torch's schedulers set the groups' lr only in step()
            for g, lr in zip(self.source.param_groups, last()):
                g["lr"] = lr


def scheduler_from_client(client, optimizer: Optional[torch.optim.Optimizer], groups: List[dict],
                          base_lr: float) -> Tuple[Any, ClientSchedule]:
    """(the scheduler, its ClientSchedule) from ``client``: a scheduler built on
    ``optimizer`` (the client optimizer), or a callable making one from it (from an
    _LrHolder of the engine's groups when the optimizer is the config's)."""
    factors = [group_factor(g, base_lr) for g in groups] or [1.0]
    if callable(client) and not hasattr(client, "step"):
        source = optimizer if optimizer is not None else _LrHolder([base_lr * f for f in factors])
        made = client(source)
        if not hasattr(made, "step"):
            raise TypeError(
                f"strata.initialize: the lr_scheduler callable returned {type(made).__name__}, not a scheduler "
                f"(an object with step())"
            )
        return made, ClientSchedule(made, source, factors)
    if not hasattr(client, "step") or not hasattr(client, "optimizer"):
        raise TypeError(
            f"strata.initialize: lr_scheduler must be a learning-rate scheduler (with step() and its optimizer) "
            f"or a callable that makes one from the optimizer, got {type(client).__name__}"
        )
    if optimizer is None:
        raise ValueError(
            "strata.initialize: a scheduler object needs the optimizer it was built on passed as optimizer= "
            "(DeepSpeed asserts the same); pass a callable lr_scheduler to build one on the engine's optimizer"
        )
    if client.optimizer is not optimizer:
        raise ValueError(
            "strata.initialize: the lr_scheduler was built on another optimizer than the one passed as "
            "optimizer=; build it on that one"
        )
    return client, ClientSchedule(client, optimizer, factors)
