"""strata.initialize's set-up: the config as text and as a dict, torch.optim-style
parameter groups, the engine's groups (the default blocks, frozen parameters, parameters
built under strata.zero.Init), and the ranks (torch.distributed's, DeepSpeed's mpu)."""

from __future__ import annotations

import json
import os
from typing import Any, List, Mapping, Optional, Union

import torch

from . import _hooks, _strata

CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


def mpu_call(mpu: Any, *names: str):
    """The first of ``names`` the mpu object has, called (DeepSpeed's and Megatron's
    spellings differ: get_model_parallel_rank / get_tensor_model_parallel_rank)."""
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    raise TypeError(f"strata.initialize: the mpu object has none of {', '.join(names)}")


def read_config(config: Union[Mapping[str, Any], str, os.PathLike]) -> str:
    if isinstance(config, Mapping):
        return json.dumps(config)
    if isinstance(config, os.PathLike) or (isinstance(config, str) and not config.lstrip().startswith("{")):
        with open(config, encoding="utf-8") as f:
            return f.read()
    if isinstance(config, str):
        return config
    raise TypeError(
        f"strata.initialize: config must be a dict, a JSON string or a path, got "
        f"{type(config).__name__}"
    )


def config_dict(config_text: str) -> dict:
    """The config as a dict, read before the engine validates it: {} when it is not a JSON
    object (the config parser then reports what is wrong, with line and column)."""
    try:
        cfg = json.loads(config_text)
    except ValueError:
        return {}
    return cfg if isinstance(cfg, dict) else {}


GROUP_KEYS = ("params", "lr", "weight_decay", "betas", "eps", "name")


def core_group_options(g: dict) -> dict:
    """A parameter group's overrides as the engine core takes them."""
    out = {}
    for key in ("lr", "weight_decay", "eps"):
        if key in g:
            out[key] = float(g[key])
    if "betas" in g:
        b1, b2 = g["betas"]
        out["beta1"], out["beta2"] = float(b1), float(b2)
    return out


def config_lr(cfg: dict) -> float:
    try:
        return float(cfg["optimizer"]["params"]["lr"])
    except (KeyError, TypeError, ValueError):
        return 1e-3  # the config parser's default for optimizer.params.lr


def param_groups(model_parameters) -> tuple:
    """torch.optim-style parameter groups (a list of dicts with "params" and overrides of
    lr, weight_decay, betas, eps) -> (parameters, groups, {id(param): group index})."""
    groups = list(model_parameters)
    params, group_of = [], {}
    for k, g in enumerate(groups):
        if not isinstance(g, dict):
            raise TypeError(
                "strata.initialize: model_parameters mixes parameters and parameter-group dicts; "
                "pass one or the other"
            )
        unknown = sorted(set(g) - set(GROUP_KEYS))
        if unknown:
            raise ValueError(
                f"strata.initialize: parameter group {k} has {', '.join(map(repr, unknown))}: Strata's "
                f"groups take {', '.join(GROUP_KEYS[1:5])} (and a name)"
            )
        if "params" not in g:
            raise ValueError(f"strata.initialize: parameter group {k} has no 'params'")
        if "betas" in g and len(tuple(g["betas"])) != 2:
            raise ValueError(f"strata.initialize: parameter group {k}: betas must be two numbers")
        ps = [g["params"]] if isinstance(g["params"], torch.Tensor) else list(g["params"])
        g["params"] = ps
        for p in ps:
            if id(p) in group_of:
                raise ValueError(
                    f"strata.initialize: a parameter is in parameter groups {group_of[id(p)]} and {k}"
                )
            group_of[id(p)] = k
            params.append(p)
    return params, groups, group_of


def default_blocks(model: torch.nn.Module, managed: set) -> List[torch.nn.Module]:
    """The default blocks (docs/python.md, "Groups"): the children of the model with managed
    parameters (trainable or frozen), looking into containers and into children that hold
    one; a module whose class a transformers model names in ``_no_split_modules`` (its
    decoder layer) is a block as it is, even when it holds containers (a PEFT LoRA layer's
    ``lora_A`` ModuleDict)."""
    no_split = set()
    for m in model.modules():
        names = getattr(m, "_no_split_modules", None)
        if isinstance(names, (list, tuple, set)):
            no_split.update(n for n in names if isinstance(n, str))

    def has_managed(module):
        return any(id(p) in managed for p in module.parameters())

    def holds_container(module):
        # A container with parameters somewhere below `module` (a wrapper such as a Hugging
        # Face LlamaModel around its `layers` ModuleList): look into it instead.
        return any(
            isinstance(m, CONTAINERS) and has_managed(m)
            for m in module.modules()
            if m is not module
        )

    out = []

    def visit(module):
        for child in module.children():
            if type(child).__name__ in no_split:
                if has_managed(child):
                    out.append(child)
            elif isinstance(child, CONTAINERS) or holds_container(child):
                visit(child)
            elif has_managed(child):
                out.append(child)

    visit(model)
    return out


def materialize_meta(model, params, groups, group_of):
    """Parameters on the meta device (built under strata.zero.Init) get CPU Parameters put in
    every module slot that held them: a trained one with no memory (the engine's storage
    replaces it; its initial value is zero until strata.load_safetensors fills it), and so
    does a frozen one (requires_grad False: the engine's frozen groups). Returns the
    parameters, groups and group_of with the new objects, {id(new): shape} of those, and the
    slots changed [(module, name, meta parameter)] (to put back when initialize fails)."""
    trained = {id(p) for p in params}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and p.is_meta and not p.requires_grad:
                trained.add(id(p))  # frozen: partitioned too
    new_of, slots = {}, []
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new_of:
                data = torch.empty(0, dtype=p.dtype) if id(p) in trained else torch.zeros(p.shape, dtype=p.dtype)
                new_of[id(p)] = (p, torch.nn.Parameter(data, requires_grad=p.requires_grad))
            slots.append((mod, name, p))
            mod._parameters[name] = new_of[id(p)][1]
    for name, b in model.named_buffers():
        if b is not None and b.is_meta:
            raise ValueError(
                f"strata.initialize: buffer {name} is on the meta device; strata.zero.Init builds only "
                f"parameters there (a model built under torch.device('meta') has no buffer values)"
            )
    if not new_of:
        return params, groups, group_of, {}, []

    def swap(p):
        return new_of[id(p)][1] if id(p) in new_of else p

    params = [swap(p) for p in params]
    if groups:
        for g in groups:
            g["params"] = [swap(p) for p in g["params"]]
    if group_of:
        group_of = {id(new_of[k][1]) if k in new_of else k: v for k, v in group_of.items()}
    shapes = {id(new): tuple(old.shape) for old, new in new_of.values() if id(old) in trained}
    return params, groups, group_of, shapes, slots


def check_blocks(model: torch.nn.Module, blocks) -> List[torch.nn.Module]:
    """The modules given as ``blocks=``: submodules of the model, each once, none inside
    another."""
    block_list = list(blocks)
    all_modules = {id(m) for m in model.modules()}
    for b in block_list:
        if not isinstance(b, torch.nn.Module) or id(b) not in all_modules:
            raise ValueError("strata.initialize: every entry of blocks must be a submodule of the model")
    if len({id(b) for b in block_list}) != len(block_list):
        raise ValueError("strata.initialize: a module is listed twice in blocks")
    for b in block_list:
        for inner in b.modules():
            if inner is not b and any(inner is c for c in block_list):
                raise ValueError("strata.initialize: blocks may not contain one another")
    return block_list


def placements(model: torch.nn.Module, blocks: List[torch.nn.Module], block_names: List[str], entries) -> list:
    """Each parameter (``entries``: (tensor, name, trains)) as the engine's group planner
    takes it (engine/protocol/groups.h): (name, the blocks holding it, whether the model
    also holds it outside every block, trains)."""
    holders = {}
    for k, b in enumerate(blocks):
        for p in b.parameters():
            holders.setdefault(id(p), []).append(k)
    prefixes = [n + "." if n else "" for n in block_names]
    outside = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        # strata.zero.register_external_parameter: used outside its block's forward too.
        if not any(name.startswith(pre) for pre in prefixes) or getattr(p, "_strata_external", False):
            outside.add(id(p))
    return [(name, holders.get(id(t), []), id(t) in outside, trains) for t, name, trains in entries]


def rendezvous(mpu: Any, config_text: str, counter: int):
    """The ranks the engine meets: a process group the user already made is reused (its
    store, rank and world size), else torchrun's environment (one process without it);
    under an mpu (DeepSpeed's model parallelism) the data-parallel group's. Returns
    (_strata.Rendezvous, global_rank, mp_rank, mp_world, (rank, world size)): without a
    store, the rank and world size the engine reads from torchrun's environment."""
    store = None
    rank, world_size, local_rank, local_world_size = 0, 1, 0, 1
    prefix = f"strata/engine{counter}"  # the same on every rank: the ranks' n-th engine
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        store = distributed_c10d._get_default_store()
        rank, world_size = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # torch.distributed's rank when it is initialized; else the engine's own (torchrun's
    # RANK, which the core reads, or 0).
    global_rank = rank if store is not None else None
    mp_rank, mp_world = 0, 1
    if mpu is not None:
        # The engine's ranks are the data-parallel group's; each such group (one per
        # model-parallel rank) runs its own engine, met under its own prefix in the store.
        if store is None:
            raise RuntimeError(
                "strata.initialize: an mpu needs torch.distributed initialized first "
                "(its groups are torch.distributed process groups)"
            )
        dp_group = mpu_call(mpu, "get_data_parallel_group")
        members = dist.get_process_group_ranks(dp_group)
        rank, world_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        prefix += "/dp" + "-".join(str(r) for r in members)
        mp_rank = int(mpu_call(mpu, "get_model_parallel_rank", "get_tensor_model_parallel_rank"))
        mp_world = int(mpu_call(mpu, "get_model_parallel_world_size", "get_tensor_model_parallel_world_size"))
        if mp_world > 1 and float(config_dict(config_text).get("gradient_clipping", 0) or 0) > 0:
            raise NotImplementedError(
                "strata.initialize: gradient_clipping with model parallelism (an mpu of "
                f"{mp_world} model-parallel ranks) is not implemented: the gradient norm "
                "would span only the data-parallel group; set gradient_clipping to 0 or clip "
                "with your own model-parallel norm"
            )
    rv = _strata.Rendezvous(store, prefix, rank, world_size, local_rank, local_world_size)
    if store is None:
        rank, world_size = int(os.environ.get("RANK") or 0), int(os.environ.get("WORLD_SIZE") or 1)
    return rv, global_rank, mp_rank, mp_world, (rank, world_size)


def monitor(config_text: str, ranks: tuple, global_rank: Optional[int], params: int):
    """The engine's monitors (strata.monitor.Monitor), made before the engine: the config as
    the engine normalizes it for the world size (``ranks``: rendezvous()'s (rank, world))."""
    from . import validate_config
    from .monitor import Monitor  # DeepSpeed's monitors (csv_monitor, tensorboard, wandb)

    rank, world = ranks
    full = validate_config(config_text, world_size=world)
    return Monitor(full, rank if global_rank is None else global_rank,
                   fp16=bool(full.get("fp16", {}).get("enabled")), train_batch_size=int(full["train_batch_size"]),
                   params=params)


def plan_groups(model: torch.nn.Module, params, blocks, meta_shapes: dict, group_of) -> tuple:
    """The engine's groups (engine/protocol/groups.h) from the blocks: the trained
    parameters, and the frozen ones (the model's requires_grad-False parameters not given
    to train: partitioned and gathered like the rest, in frozen groups, with no optimizer
    state, gradient or weight decay). Parameters that require grad but were left out of
    model_parameters stay ordinary tensors. Returns ([_hooks.Group], ids of the managed
    parameters)."""
    names, aliases = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
        aliases.setdefault(id(p), []).append(name)
    for p in params:
        if id(p) not in names:
            raise ValueError("strata.initialize: model_parameters holds a tensor that is not a parameter of the model")
    # DeepSpeed's idiom passes model.parameters() whole: those that do not require grad are
    # frozen, as the ones left out are.
    params = [p for p in params if p.requires_grad]
    managed = {id(p) for p in params}
    frozen, seen = [], set()
    for p in model.parameters():
        if not p.requires_grad and id(p) not in managed and id(p) not in seen:
            seen.add(id(p))
            frozen.append(p)
    managed |= seen
    block_list = default_blocks(model, managed) if blocks is None else check_blocks(model, blocks)
    module_names = {id(m): n for n, m in model.named_modules()}
    block_names = [module_names.get(id(b), f"block{k}") for k, b in enumerate(block_list)]
    entries = [(p, names[id(p)], True) for p in params] + [(p, names[id(p)], False) for p in frozen]
    groups = []
    for i, g in enumerate(_strata.plan_groups(block_names, placements(model, block_list, block_names, entries))):
        group = _hooks.Group(i, g["name"], block_list[g["block"]] if g["block"] >= 0 else None, g["frozen"],
                             g["companion"])
        for k in g["params"]:
            p, name, trains = entries[k]
            group.add(p, name, meta_shapes.get(id(p)), (group_of or {}).get(id(p), 0) if trains else 0,
                      [n for n in aliases[id(p)] if n != name])
        groups.append(group)
    return groups, managed
