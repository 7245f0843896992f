"""``strata.zero.Init``: build a model larger than host memory (issue #18).

    with strata.zero.Init():
        model = AutoModelForCausalLM.from_config(cfg)     # no parameter memory is kept
    engine, *_ = strata.initialize(model=model, config=ds_config)   # only this rank's shards
    strata.load_safetensors(engine, "checkpoint/model.safetensors.index.json")

Inside the context every parameter a module registers is replaced, as it is registered, by
a parameter of the same shape, dtype and requires_grad on the meta device (a module
registration hook): its memory is freed at once, so building holds one parameter at a
time. Buffers stay real (rotary tables and masks computed in ``__init__`` keep their
values). ``strata.initialize`` then gives each trained parameter engine storage and only
this rank's shard of it, zero, frozen ones too (in frozen groups); a forward before
``strata.load_safetensors`` raises, so a model never trains from the zeros by accident.

Why this and not DeepSpeed's way (partition each module's parameters after its
``__init__``): initial values drawn while building do not survive a Hugging Face model's
``post_init()``, which re-initializes every weight at the end of the top-level constructor
(DeepSpeed patches transformers for it), and the values of a model built piece by piece
cannot equal plain construction's anyway (the random generator's order differs). The use
this serves is the one where a model exceeds host memory: fine-tuning from a checkpoint,
which ``strata.load_safetensors`` streams into the shards, each rank reading its slices.
Training such a model from random initial values is not offered yet. (The C++ front end's
``strata::ZeroInit`` partitions real values as each block is built: docs/engine.md.)
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook

__all__ = ["Init"]

_active = False


def _to_meta(module: torch.nn.Module, name: str, param):
    if param is None or param.is_meta:
        return None
    return torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


class Init:
    """Context manager: parameters registered inside it are built on the meta device.

    ``config`` (a dict, JSON string or path, DeepSpeed's ``config_dict_or_path`` too) is
    validated when given; nothing in it changes how the model is built. ``enabled=False``
    makes the context do nothing (DeepSpeed's switch)."""

    def __init__(
        self,
        config: Union[Mapping[str, Any], str, None] = None,
        *,
        config_dict_or_path: Union[Mapping[str, Any], str, None] = None,
        enabled: bool = True,
    ):
        from . import validate_config

        config = config if config is not None else config_dict_or_path
        if config is not None:
            validate_config(config)
        self.enabled = enabled
        self._handle: Optional[Any] = None

    def __enter__(self) -> "Init":
        global _active
        if not self.enabled:
            return self
        if _active:
            raise RuntimeError("strata.zero.Init: already inside a strata.zero.Init (one at a time)")
        _active = True
        self._handle = register_module_parameter_registration_hook(_to_meta)
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            _active = False
