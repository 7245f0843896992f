"""``strata.initialize``: DeepSpeed's calling convention over strata.engine.Engine, and the
assembly of a model strata.zero.Init built partitioned."""

from __future__ import annotations

import itertools
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Union

import torch

from . import _client, _hooks, _pretrained, _setup, _strata
from .engine import Engine

__all__ = ["initialize", "load_safetensors"]

_engine_counter = itertools.count()  # the ranks' n-th engine: its keys in the store


def _trained(model: torch.nn.Module, model_parameters) -> tuple:
    """(params, torch.optim-style groups or None, {id(param): group} or None) from
    ``model_parameters`` (default: every parameter that requires grad)."""
    if model_parameters is None:
        return [p for p in model.parameters() if p.requires_grad], None, None
    model_parameters = list(model_parameters)
    if model_parameters and isinstance(model_parameters[0], dict):
        return _setup.param_groups(model_parameters)
    params, seen = [], set()
    for p in model_parameters:
        if isinstance(p, dict):
            raise TypeError(
                "strata.initialize: model_parameters mixes parameters and parameter-group dicts; "
                "pass one or the other"
            )
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params, None, None


def initialize(
    args: Any = None,
    model: Optional[torch.nn.Module] = None,
    optimizer: Any = None,
    model_parameters: Optional[Iterable[torch.nn.Parameter]] = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    mpu: Any = None,
    dist_init_required: Optional[bool] = None,
    collate_fn: Any = None,
    config: Union[Mapping[str, Any], str, os.PathLike, None] = None,
    config_params: Union[Mapping[str, Any], str, None] = None,
    *,
    blocks: Optional[Sequence[torch.nn.Module]] = None,
    prefetch: bool = True,
    timeout: float = 300.0,
):
    """Wraps ``model`` in a ZeRO-3 engine; returns ``(engine, optimizer, None, scheduler)``.

    ``config``: a DeepSpeed-style dict, JSON string or path (``config_params`` is an
    alias); the optimizer and scheduler come from it, or from a client ``optimizer`` (Adam
    or AdamW, or a callable making one) and ``lr_scheduler`` (strata/_client.py).
    ``model_parameters``: the parameters to train (default: every
    parameter that requires grad), or torch.optim-style parameter groups (dicts with
    "params" and any of lr, weight_decay, betas, eps overriding the config's optimizer
    values; a group's lr follows the schedule in proportion); the others stay ordinary
    tensors. ``blocks``: the modules that become groups (default: strata.engine's module
    docstring). Rank and world size: an initialized torch.distributed process group (its
    store is reused), else torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT), else one process.
    """
    if model is None:
        raise ValueError("strata.initialize: model is required")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"strata.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "strata_config", None)
    if config is None:
        raise ValueError("strata.initialize: config is required (a dict, a JSON string or a path)")
    if training_data is not None:
        raise NotImplementedError("strata.initialize: training_data is not supported; build the DataLoader yourself")
    _check_not_wrapped(model)
    compiled = _hooks.compiled_modules(model)
    if compiled:
        raise ValueError(f"{_hooks.COMPILE_ERROR} Compiled here: {', '.join(compiled[:5])}")
    text = _setup.read_config(config)
    client_optimizer, client_schedule = None, None
    if optimizer is not None or lr_scheduler is not None:
        text, model_parameters, client_optimizer, lr_scheduler, client_schedule = _client_objects(
            model, text, model_parameters, optimizer, lr_scheduler)
    params, groups, group_of = _trained(model, model_parameters)
    params, groups, group_of, meta_shapes, meta_slots = _setup.materialize_meta(model, params, groups, group_of)
    try:
        parts = _partitioned_parameters(model, params)
        meta_shapes.update({k: part.shape for k, (_, part) in parts.items()})
        engine = Engine(model, text, params, blocks, prefetch, timeout, groups, group_of, meta_shapes, mpu,
                        next(_engine_counter))
    except BaseException:
        _put_back(meta_slots)
        raise
    pretrained = getattr(model, "_strata_pretrained", None)
    try:
        if parts:
            _assemble(engine, parts)
            engine._needs_load = any(k not in parts for k in meta_shapes)
        if pretrained is not None and meta_shapes:
            # from_pretrained under strata.zero.Init: the checkpoint's values, each rank
            # reading only its slices.
            missing = getattr(model, "_strata_missing", [])
            engine._core.load_safetensors(os.fspath(pretrained), engine._whole_tensors(), missing)
            engine._needs_load = False
            if missing:
                _pretrained.initialize_missing(engine, model, missing)
                del model._strata_missing
            del model._strata_pretrained
    except BaseException:
        # The same on every rank: the failures above are agreed on. The parts strata.zero.Init
        # made (and the checkpoint from_pretrained named) stay, for another initialize.
        engine.close(restore=True, keep_empty=set(meta_shapes))
        _put_back(meta_slots)
        raise
    if client_schedule is not None:
        engine._client_schedule = client_schedule
        engine.lr_scheduler = lr_scheduler
        engine.set_lr(client_schedule.base_lr())
    return engine, engine.optimizer, None, engine.lr_scheduler


def _client_objects(model, text: str, model_parameters, optimizer, lr_scheduler) -> tuple:
    """DeepSpeed's client optimizer and scheduler (strata/_client.py): (the config text with
    the optimizer's section and without its scheduler section when a client scheduler is
    given, model_parameters as the optimizer's groups, the optimizer, the scheduler, its
    ClientSchedule or None)."""
    import json
    import logging

    cfg = json.loads(text)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    model_parameters = list(model_parameters)
    client = None
    if optimizer is not None:
        client, model_parameters = _client.optimizer_from_client(optimizer, model_parameters, cfg)
    schedule = None
    if lr_scheduler is not None:
        if cfg.pop("scheduler", None):
            logging.getLogger("strata").info(
                "strata.initialize: the client lr_scheduler is used; the config's scheduler section is left out")
        groups = [g for g in model_parameters if isinstance(g, dict)]
        # A scheduler object needs the optimizer object it was built on (a callable optimizer
        # makes its own, which no scheduler made before could be built on).
        built_on = client if isinstance(optimizer, torch.optim.Optimizer) or not hasattr(lr_scheduler, "step") else None
        lr_scheduler, schedule = _client.scheduler_from_client(lr_scheduler, built_on, groups, _setup.config_lr(cfg))
    return json.dumps(cfg), model_parameters, client, lr_scheduler, schedule


def _put_back(slots) -> None:
    """The parameters strata.zero.Init(meta=True) built, back in their modules' slots."""
    for module, name, meta in slots:
        module._parameters[name] = meta


def _check_not_wrapped(model: torch.nn.Module) -> None:
    """A model another engine holds (or held, and took the values with it when closed) would
    give an engine of empty parameters: refused, naming the cause."""
    for name, p in model.named_parameters():
        ref = getattr(p, "_strata_engine", None)
        if ref is None:
            continue
        other = ref()
        if other is not None and not other._closed:
            raise RuntimeError(
                f"strata.initialize: the model is already wrapped by an engine (its parameter {name} is held "
                f"by it): use the engine the first strata.initialize returned (engine.module is the model), "
                f"or close it with engine.destroy(restore=True), which gives the model its values back, first"
            )
        raise RuntimeError(
            f"strata.initialize: the model's parameters went with an engine that was closed (parameter {name} "
            f"is empty): close an engine with engine.destroy(restore=True) to keep the model's values, or "
            f"build the model again (its weights: engine.save_16bit_model before closing)"
        )


def _partitioned_parameters(model: torch.nn.Module, params) -> Dict[int, tuple]:
    """The parameters strata.zero.Init partitioned as it built them: {id: (param, part)}.
    Each must be the engine's (trained, or frozen: requires_grad False)."""
    from .zero import partitioned

    trained = {id(p) for p in params}
    out = {}
    for name, p in model.named_parameters():
        part = partitioned(p)
        if part is None or id(p) in out:
            continue
        if p.requires_grad and id(p) not in trained:
            raise ValueError(
                f"strata.initialize: parameter {name} was partitioned by strata.zero.Init but is left out of "
                f"model_parameters, so no engine would hold it: train it (or freeze it with requires_grad=False), "
                f"or build it outside the context"
            )
        out[id(p)] = (p, part)
    return out


def _assemble(engine: Engine, parts: Dict[int, tuple]) -> None:
    """Collective: the engine's shards made from every rank's parts (EngineCore::
    AssembleParameters), in the engine's group order."""
    check, items = "", []
    for g in engine._groups:
        for i, p in enumerate(g.params):
            entry = parts.get(id(p))
            if entry is None:
                continue
            part = entry[1]
            if (part.rank, part.world) != (engine.rank, engine.world_size) and not check:
                check = (
                    f"parameter {g.names[i]} was partitioned by strata.zero.Init as rank {part.rank} of "
                    f"{part.world}, the engine is rank {engine.rank} of {engine.world_size}: build the model "
                    f"under the same ranks (pass the engine's mpu to strata.zero.Init)"
                )
            items.append((g.index, i, part.part))
    engine._core.assemble_parameters(items, check)
    items = []  # it held the part tensors too
    for p, part in parts.values():
        del p._strata_part
        part.part = None  # its memory goes back now, not when initialize returns
    _strata.trim_heap()  # to the system, not kept on the heap


def load_safetensors(engine: Engine, path: Union[str, os.PathLike]) -> None:
    """``engine.load_safetensors(path)``: initial weights from safetensors files, each rank
    reading only its slices."""
    engine.load_safetensors(path)
