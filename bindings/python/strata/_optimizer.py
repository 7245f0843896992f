"""What ``strata.initialize`` returns as the optimizer and the scheduler: views of the
engine's CPU Adam and learning-rate schedule, which ``engine.step()`` applies."""

from __future__ import annotations

from typing import List


def group_factor(group: dict, base_lr: float) -> float:
    """A parameter group's learning rate over the base rate (1 without an ``lr`` of its own)."""
    return group["lr"] / base_lr if "lr" in group and base_lr > 0 else 1.0


class EngineOptimizer:
    """What initialize returns as the optimizer: the engine's CPU Adam, configured by the
    config's ``optimizer`` section and the parameter groups. ``param_groups[k]["lr"]``
    follows the engine's learning rate (the schedule's, times the group's factor); setting
    it calls ``engine.set_lr`` with the base rate that gives the group that value. Call
    ``engine.step()``, not ``step()``."""

    def __init__(self, engine, groups: List[dict], base_lr: float):
        self._engine = engine
        # [{"params": [...], overrides..., "factor": the group's lr over the base lr}]
        self._groups = [dict(g, factor=group_factor(g, base_lr)) for g in groups]

    @property
    def param_groups(self) -> List[dict]:
        engine = self._engine

        class _Group(dict):
            def __setitem__(self, key, value):
                if key == "lr":
                    engine.set_lr(value / self.factor)
                super().__setitem__(key, value)

        base = engine.get_lr()[0]
        out = []
        for g in self._groups:
            d = _Group({k: v for k, v in g.items() if k != "factor"})
            d.factor = g["factor"]
            dict.__setitem__(d, "lr", base * g["factor"])
            out.append(d)
        return out

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine frees every gradient as it arrives."""

    def step(self, closure=None):
        raise RuntimeError("strata: call engine.step() (the engine applies the optimizer)")


class EngineScheduler:
    """What initialize returns as the scheduler when the config has a ``scheduler``
    section: the engine applies the schedule at every step; this object reports it."""

    def __init__(self, engine):
        self._engine = engine

    def get_last_lr(self) -> List[float]:
        return self._engine.get_lr()

    def get_lr(self) -> List[float]:
        return self._engine.get_lr()

    def step(self, *args, **kwargs) -> None:
        """Nothing to do: engine.step() advances the schedule."""

    def state_dict(self) -> dict:
        """DeepSpeed's scheduler state: ``{"last_batch_iteration": n}``, the iteration whose
        rate the last applied step used (``first_iteration - 1`` before any); a checkpoint
        keeps it too."""
        return {"last_batch_iteration": self._engine._core.lr_iteration() - 1}

    def load_state_dict(self, state: dict) -> None:
        """Moves the schedule to ``state["last_batch_iteration"]`` (the next applied step uses
        the rate of the iteration after it). Between steps, not between a backward and its
        step."""
        if not isinstance(state, dict) or not isinstance(state.get("last_batch_iteration"), int):
            raise ValueError(
                "strata: EngineScheduler.load_state_dict takes {'last_batch_iteration': int} (what "
                f"state_dict() returns), got {state!r}"
            )
        if state["last_batch_iteration"] < -1:
            raise ValueError(f"strata: last_batch_iteration must be >= -1, got {state['last_batch_iteration']}")
        self._engine._core.set_lr_iteration(state["last_batch_iteration"] + 1)
