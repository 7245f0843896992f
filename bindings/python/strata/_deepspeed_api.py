"""The counters and switches of DeepSpeed's engine that scripts read (``engine.global_steps``,
``engine.train_batch_size()``, ``engine.was_step_applied()``, ...), with DeepSpeed's names and
meanings, for strata.engine.Engine; and the answer for an attribute neither the engine nor
its model has, which names the engine (DeepSpeed's engine passes such a lookup to the model,
whose error then names the model's class: "'MyModel' object has no attribute
'global_steps'")."""

from __future__ import annotations

import json
import os
from typing import List, Optional, Tuple

# DeepSpeed engine attributes a script may reach for that Strata does not have, and why.
_NOT_IN_STRATA = {
    "set_gradient_accumulation_boundary": "the engine counts micro-steps itself: a boundary is every "
    "gradient_accumulation_steps-th backward (pipeline parallelism, which overrides it in DeepSpeed, is not "
    "supported)",
    "no_sync": "with ZeRO stages 2 and 3 gradients are partitioned as they arrive (DeepSpeed refuses "
    "no_sync there too); accumulate with gradient_accumulation_steps instead",
}


class DeepSpeedApiMixin:
    """DeepSpeed engine's counters and settings (the module docstring). The class using it
    sets ``_global_steps``, ``_last_step`` (the last ``step()``'s outcome) and ``_core``."""

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (gradient-accumulation boundaries), skipped ones included;
        restored by load_checkpoint."""
        return self._global_steps

    @property
    def global_samples(self) -> int:
        """Samples trained on: global_steps x train_batch_size()."""
        return self._global_steps * self.train_batch_size()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for an fp16 overflow (the loss scale lowered instead)."""
        return int(self._core.skipped_steps())

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine: torchrun's LOCAL_RANK (0 without it)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    def _config_value(self, key: str):
        return self._normalized_config()[key]

    def _normalized_config(self) -> dict:
        cached = self.__dict__.get("_normalized")
        if cached is None:
            cached = self.__dict__["_normalized"] = json.loads(self._core.normalized_config)
        return cached

    def train_batch_size(self) -> int:
        return int(self._config_value("train_batch_size"))

    def train_micro_batch_size_per_gpu(self) -> int:
        return int(self._config_value("train_micro_batch_size_per_gpu"))

    def gradient_accumulation_steps(self) -> int:
        return int(self._config_value("gradient_accumulation_steps"))

    def zero_optimization_stage(self) -> int:
        return int(self._normalized_config().get("zero_optimization", {}).get("stage", 0))

    def bfloat16_enabled(self) -> bool:
        return bool(self._normalized_config().get("bf16", {}).get("enabled", False))

    def fp16_enabled(self) -> bool:
        return bool(self._normalized_config().get("fp16", {}).get("enabled", False))

    def get_global_grad_norm(self) -> Optional[float]:
        """The gradients' global norm at the last applied or skipped step (before clipping);
        None before the first step."""
        last = self._last_step
        return None if last is None else float(last["global_norm"])

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the parameters (False: not a boundary, or an fp16
        overflow skipped it; DeepSpeed's meaning)."""
        last = self._last_step
        return bool(last is not None and last["applied"])

    def get_mom(self) -> List[Tuple[float, float]]:
        """Adam's betas per parameter group, as a list (DeepSpeed's convention)."""
        return [tuple(g.get("betas", self._betas)) for g in self.optimizer.param_groups]

    def empty_partition_cache(self) -> None:
        """DeepSpeed's call to free the gathered parameters between phases: nothing to do,
        the engine releases every gathered group at the end of each forward and backward and
        after an evaluation forward (DeepSpeed's tests call it before a save)."""

    def destroy(self, restore: bool = False) -> None:
        """DeepSpeed's name for close() (``restore``: a collective; the model gets its values
        back, for another engine)."""
        self.close(restore=restore)

    def _missing(self, name: str) -> AttributeError:
        why = _NOT_IN_STRATA.get(name)
        if why is not None:
            return AttributeError(f"strata: the engine has no {name} (DeepSpeed's engine has): {why}")
        model = type(self.__dict__.get("module")).__name__
        return AttributeError(f"strata: neither the engine nor its model ({model}) has an attribute {name!r}")
