"""from_pretrained under strata.zero.Init with weights the checkpoint lacks (a new head:
``AutoModelForSequenceClassification.from_pretrained(base)``), as transformers loads them:
the checkpoint's values for every parameter it has, the model's own initialization
(``_init_weights``) for the others, with transformers' warning naming them.

A checkpoint's tensors the model has no parameter for (an old head) are refused by the load,
named: save the base without them, or load it plainly.
"""

from __future__ import annotations

import json
import logging
from typing import Dict, List

import torch

from . import _safetensors


def checkpoint_names(weights: str) -> set:
    """The tensor names of a safetensors file, or of the files an index JSON lists."""
    if weights.endswith(".json"):
        with open(weights, encoding="utf-8") as f:
            return set(json.load(f).get("weight_map", {}))
    with open(weights, "rb") as f:
        return {k for k in _safetensors.header(f) if k != "__metadata__"}


def missing_parameters(model: torch.nn.Module, weights: str) -> List[str]:
    """The model's parameters (their first names) none of whose names the checkpoint has.
    A checkpoint with tensors the model has no parameter or buffer for is refused here,
    naming them (an old head, or keys transformers converts when it loads)."""
    have = checkpoint_names(weights)
    known = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    extra = sorted(have - known)
    if extra:
        raise ValueError(
            f"strata.zero.Init: from_pretrained: the checkpoint {weights} has {len(extra)} tensors "
            f"{type(model).__name__} has no parameter for: {', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}. "
            f"Strata loads a checkpoint by the model's own parameter names; transformers renames or fuses some "
            f"architectures' keys when it loads (its conversion mapping: Mixtral's experts, for one), which "
            f"Strata does not do. Load this model without strata.zero.Init (strata.initialize partitions it), "
            f"or drop those tensors from the checkpoint"
        )
    names: Dict[int, List[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [ns[0] for ns in names.values() if not any(n in have for n in ns)]


def warn_missing(model: torch.nn.Module, path: str, missing: List[str]) -> None:
    logging.getLogger("strata").warning(
        "Some weights of %s were not initialized from the model checkpoint at %s and are newly initialized: "
        "%s. You should probably TRAIN this model on a down-stream task to be able to use it for predictions "
        "and inference.", type(model).__name__, path, missing)


def initialize_missing(engine, model: torch.nn.Module, missing: List[str]) -> None:
    """Collective: the missing parameters set by the model's own ``_init_weights`` of their
    modules, run on rank 0 with the modules' parameters gathered (the others keep the
    checkpoint's values)."""
    from .zero import GatheredParameters

    init = getattr(model, "_init_weights", None)
    if init is None:
        raise ValueError(
            f"strata.initialize: {type(model).__name__} has no _init_weights to initialize the weights its "
            f"checkpoint lacks ({', '.join(missing[:5])}): load it plainly, or give a checkpoint with them"
        )
    wanted = set(missing)
    for mod_name, module in model.named_modules():
        own = [(f"{mod_name}.{n}" if mod_name else n, p) for n, p in module._parameters.items() if p is not None]
        if not any(n in wanted for n, _ in own):
            continue
        with GatheredParameters([p for _, p in own], modifier_rank=0), torch.no_grad():
            kept = [(p, p.detach().clone()) for n, p in own if n not in wanted]
            init(module)
            for p, value in kept:  # what the checkpoint gave stays
                p.copy_(value)
