"""strata.initialize: the ZeRO-3 engine for any torch.nn.Module, driven from Python.

A Python front end over the torch-free ``EngineCore`` (engine/engine_core.h), doing what
engine/zero3.cc does for LibTorch modules (docs/engine.md, "What a LibTorch front end must
do"; docs/python.md, "How the hooks work"):

- groups: group 0 ("root") holds every managed parameter outside the blocks; groups 1..
  are the blocks: by default the direct children of the model that have parameters, where
  containers (nn.Sequential, nn.ModuleList, nn.ModuleDict), and modules that hold one, are
  looked into, so each of their children that has parameters is a block (a Hugging Face
  LlamaForCausalLM: each decoder layer and the final norm); or the modules passed as
  ``blocks=``.
  A parameter shared by two blocks (tied weights) goes to the root group.
- parameter tensors share memory with the engine: each managed parameter owns one storage
  whose data pointer is set to the gathered buffer (no copy) while its group is gathered,
  and to nothing otherwise; views autograd saved in the forward share that storage, so
  they see the re-gathered buffer in the backward.
- forward pre/post hooks on each block gather and release its group; an autograd Function
  around the block's outputs re-gathers it before its gradient functions run
  (pre-backward); post-accumulate-grad hooks on each parameter hand the gradient to the
  engine and free it; when every gradient of a block arrived, its backward is closed
  (post-backward). The root group is gathered from initialize/step() to the end of
  backward().
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import io
import itertools
import json
import math
import os
import random
import sys
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch
from torch.utils import _pytree

from . import _strata

__all__ = ["initialize", "load_safetensors", "Engine", "EngineOptimizer", "EngineScheduler"]

_CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_engine_counter = itertools.count()
# Checkpoint blob names (engine/checkpoint.h): unmanaged parameters (requiring grad but left out
# of model_parameters; frozen ones are in the engine's frozen groups) are the same on every rank
# (rank 0's is kept), buffers are each rank's own.
_FROZEN_BLOB = "shared:module:"
_BUFFER_BLOB = "module:"
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _rng_states(device: torch.device) -> Dict[str, bytes]:
    """This process's random generators, as checkpoint blobs."""
    out = {"rng:torch_cpu": torch.get_rng_state().numpy().tobytes()}
    if device.type == "cuda":
        out["rng:torch_cuda"] = torch.cuda.get_rng_state(device).numpy().tobytes()
    version, state, gauss = random.getstate()
    out["rng:python"] = json.dumps([version, list(state), gauss]).encode()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["rng:numpy"] = json.dumps([name, keys.tolist(), pos, has_gauss, cached]).encode()
    return out


def _set_rng_states(device: torch.device, blobs: Dict[str, bytes]) -> None:
    if "rng:torch_cpu" in blobs:
        torch.set_rng_state(torch.frombuffer(bytearray(blobs["rng:torch_cpu"]), dtype=torch.uint8))
    if device.type == "cuda" and "rng:torch_cuda" in blobs:
        torch.cuda.set_rng_state(
            torch.frombuffer(bytearray(blobs["rng:torch_cuda"]), dtype=torch.uint8), device
        )
    if "rng:python" in blobs:
        version, state, gauss = json.loads(blobs["rng:python"])
        random.setstate((version, tuple(state), gauss))
    np = sys.modules.get("numpy")
    if np is not None and "rng:numpy" in blobs:
        name, keys, pos, has_gauss, cached = json.loads(blobs["rng:numpy"])
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


class _Param:
    __slots__ = ("param", "name", "shape", "numel", "meta", "full", "empty", "cdata", "nbytes", "acc", "arrived", "pgroup")

    def __init__(self, param: torch.nn.Parameter, name: str, shape: Optional[tuple] = None):
        self.param = param
        self.name = name
        # A parameter built under strata.zero.Init has no memory: its shape comes from there.
        self.shape = tuple(param.shape) if shape is None else tuple(shape)
        self.numel = math.prod(self.shape)
        self.meta = shape is not None
        self.full = None
        self.empty = None
        self.cdata = 0
        self.nbytes = 0
        self.acc = None
        self.arrived = False
        self.pgroup = 0


class _Group:
    def __init__(self, index: int, name: str, module: Optional[torch.nn.Module], frozen: bool = False):
        self.index = index
        self.name = name
        self.module = module
        self.params: List[_Param] = []
        self.open = 0
        self.open_backward = 0
        self.arrived = 0
        # Frozen parameters (requires_grad False) form a companion group, gathered with its
        # owner, after every trainable group; `frozen` marks such a companion.
        self.frozen = frozen
        self.companion: Optional["_Group"] = None
        self.frozen_params: List[_Param] = []  # collected before the companion is made


class _GroupIdentity(torch.autograd.Function):
    """Identity on tensors around a block; subclasses act in the backward."""

    @staticmethod
    def forward(ctx, engine, group, *tensors):
        ctx.engine = engine
        ctx.group = group
        return tensors


class _PreBackward(_GroupIdentity):
    """Identity on a block's outputs; its backward re-gathers the block (pre-backward)."""

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._on_pre_backward(ctx.group)
        return (None, None) + grads


class _PostBackward(_GroupIdentity):
    """Identity on the inputs of a block with no trainable parameter (all frozen); its
    backward runs once the block's backward produced the inputs' gradients, and releases
    the block (no parameter gradient would tell when that is)."""

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._on_post_backward(ctx.group)
        return (None, None) + grads


def _mpu_call(mpu: Any, *names: str):
    """The first of ``names`` the mpu object has, called (DeepSpeed's and Megatron's
    spellings differ: get_model_parallel_rank / get_tensor_model_parallel_rank)."""
    for name in names:
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    raise TypeError(f"strata.initialize: the mpu object has none of {', '.join(names)}")


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread: a forward hook
    that fires then is activation checkpointing's recompute."""
    return torch._C._current_graph_task_id() != -1


def _eager(fn):
    """Strata's hooks never run inside a Dynamo graph: they call into the engine (gathers,
    data-pointer swaps), which Dynamo cannot trace. While Dynamo is not imported (nothing
    compiled yet) the hooks stay as they are: importing it loads Triton, about 110 MiB of
    resident memory per rank. A torch.compile later still meets the hooks' first check,
    _under_torch_compile, which Dynamo cannot trace (sys._getframe: it warns so) and runs
    eagerly, and which then raises (tests/python/test_engine.py)."""
    if "torch._dynamo" not in sys.modules:
        return fn
    return torch.compiler.disable(fn, recursive=True)


_COMPILE_ERROR = (
    "strata: a Strata-wrapped model does not work under torch.compile: Strata gathers and "
    "releases each block's parameters in forward hooks that Dynamo cannot trace, so Dynamo "
    "would fall back to running the model eagerly (nothing compiled). Call the engine "
    "without torch.compile (engine(x), not torch.compile(model)(x) or model.compile())."
)


def _under_torch_compile() -> bool:
    """Whether a torch.compile'd callable is on the stack (Dynamo's OptimizedModule or its
    compile wrapper, in torch/_dynamo/eval_frame.py): Dynamo runs a hook it cannot trace
    eagerly and would otherwise swallow an error raised while tracing. Internal names,
    checked on torch 2.11.0 (engine/torch_internal.h). Without Dynamo imported nothing is
    compiled; importing it here would load Triton into processes that never compile."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return False
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename == eval_frame.__file__:
            owner = type(f.f_locals.get("self")).__name__
            if owner in ("OptimizeContext", "OptimizedModule"):
                return True
        f = f.f_back
    return False


def _compiled_modules(model: torch.nn.Module) -> List[str]:
    return [
        name or "<model>"
        for name, m in model.named_modules()
        if getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule"
    ]


def _storage_impl(storage: torch.UntypedStorage) -> int:
    """The address of ``storage``'s c10::StorageImpl, which _strata.set_storage_data points
    at engine memory. ``UntypedStorage._cdata`` is internal: no public API exposes it
    (checked on torch 2.11.0; engine/torch_internal.h lists every internal in use)."""
    return storage._cdata


def _read_config(config: Union[Mapping[str, Any], str, os.PathLike]) -> str:
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


def _config_dict(config_text: str) -> dict:
    """The config as a dict, read before the engine validates it: {} when it is not a JSON
    object (the config parser then reports what is wrong, with line and column)."""
    try:
        cfg = json.loads(config_text)
    except ValueError:
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _compute_device(model, params, names, cfg: dict) -> torch.device:
    """strata.device: auto = where the trained parameters are (all on one device), cuda =
    cuda:LOCAL_RANK (a model on the CPU is taken from there), cpu = the CPU."""
    seen = None
    for p in params:
        if seen is None:
            seen = (p.device, names[id(p)])
        elif p.device != seen[0]:
            raise ValueError(
                f"strata.initialize: parameter {names[id(p)]} is on {p.device} but {seen[1]} is on "
                f"{seen[0]}; put the whole model on one device"
            )
    model_device = seen[0] if seen else torch.device("cpu")
    if model_device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"strata.initialize: the model is on {model_device}; Strata computes on the CPU or on CUDA"
        )
    section = cfg.get("strata")
    wanted = str(section.get("device", "auto") if isinstance(section, dict) else "auto").lower()
    if wanted == "cpu":
        if model_device.type != "cpu":
            raise ValueError(
                f"strata.initialize: strata.device = cpu but the model is on {model_device} (move it "
                f"to the CPU, or set strata.device to auto or cuda)"
            )
        return model_device
    if wanted == "cuda":
        target = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if model_device.type == "cuda" and model_device != target:
            raise ValueError(
                f"strata.initialize: strata.device = cuda means {target} (LOCAL_RANK) on this rank, "
                f"but the model is on {model_device}"
            )
    elif model_device.type == "cuda":
        target = torch.device("cuda", model_device.index if model_device.index is not None else 0)
    else:
        return model_device  # auto on the CPU (a bad value is the config parser's error)
    if not torch.cuda.is_available() or target.index >= torch.cuda.device_count():
        raise ValueError(
            f"strata.initialize: the compute device is {target} but torch sees "
            f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} CUDA devices"
        )
    return target


_GROUP_KEYS = ("params", "lr", "weight_decay", "betas", "eps", "name")


def _core_group_options(g: dict) -> dict:
    """A parameter group's overrides as the engine core takes them."""
    out = {}
    for key in ("lr", "weight_decay", "eps"):
        if key in g:
            out[key] = float(g[key])
    if "betas" in g:
        b1, b2 = g["betas"]
        out["beta1"], out["beta2"] = float(b1), float(b2)
    return out


def _config_lr(cfg: dict) -> float:
    try:
        return float(cfg["optimizer"]["params"]["lr"])
    except (KeyError, TypeError, ValueError):
        return 1e-3  # the config parser's default for optimizer.params.lr


def _param_groups(model_parameters) -> tuple:
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
        unknown = sorted(set(g) - set(_GROUP_KEYS))
        if unknown:
            raise ValueError(
                f"strata.initialize: parameter group {k} has {', '.join(map(repr, unknown))}: Strata's "
                f"groups take {', '.join(_GROUP_KEYS[1:5])} (and a name)"
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


def _default_blocks(model: torch.nn.Module, managed: set) -> List[torch.nn.Module]:
    def holds_container(module):
        # A container with parameters somewhere below `module` (a wrapper such as a Hugging
        # Face LlamaModel around its `layers` ModuleList): look into it instead.
        return any(
            isinstance(m, _CONTAINERS) and any(id(p) in managed for p in m.parameters())
            for m in module.modules()
            if m is not module
        )

    out = []

    def visit(module):
        for child in module.children():
            if isinstance(child, _CONTAINERS) or holds_container(child):
                visit(child)
            elif any(id(p) in managed for p in child.parameters()):
                out.append(child)

    visit(model)
    return out


class EngineOptimizer:
    """What initialize returns as the optimizer: the engine's CPU Adam, configured by the
    config's ``optimizer`` section and the parameter groups. ``param_groups[k]["lr"]``
    follows the engine's learning rate (the schedule's, times the group's factor); setting
    it calls ``engine.set_lr`` with the base rate that gives the group that value. Call
    ``engine.step()``, not ``step()``."""

    def __init__(self, engine: "Engine", groups: List[dict]):
        self._engine = engine
        self._groups = groups  # [{"params": [...], overrides..., "factor": lr factor}]

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
            d.factor = g["factor"]  # the group's lr over the engine's base lr
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

    def __init__(self, engine: "Engine"):
        self._engine = engine

    def get_last_lr(self) -> List[float]:
        return self._engine.get_lr()

    def get_lr(self) -> List[float]:
        return self._engine.get_lr()

    def step(self, *args, **kwargs) -> None:
        """Nothing to do: engine.step() advances the schedule."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class Engine:
    """The object ``strata.initialize`` returns (DeepSpeed's engine calling convention).

    ``engine(*args, **kwargs)`` runs the model (under ``torch.no_grad()`` it is an
    evaluation forward), ``engine.backward(loss)``, ``engine.step()`` after every
    backward, ``engine.get_lr()``, ``engine.statistics()``, ``engine.gather_parameters()``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config_text: str,
        params: List[torch.nn.Parameter],
        blocks: Optional[Sequence[torch.nn.Module]],
        prefetch: bool,
        timeout_s: float,
        param_groups: Optional[List[dict]] = None,
        group_of: Optional[Dict[int, int]] = None,
        meta_shapes: Optional[Dict[int, tuple]] = None,
        mpu: Any = None,
    ):
        self.module = model
        meta_shapes = meta_shapes or {}
        # Built under strata.zero.Init: no values until strata.load_safetensors.
        self._needs_load = bool(meta_shapes)
        self._error: Optional[BaseException] = None
        self._void_recovered = False  # _recover_void ran since the last forward began
        self._backward_pending = False
        self._in_eval = False
        self._handles = []
        managed = {id(p) for p in params}
        # Frozen parameters: the model's requires_grad-False ones not given to train. They are
        # partitioned and gathered like the rest, in frozen groups (no optimizer state, no
        # gradient, no weight decay). Parameters that require grad but were left out of
        # model_parameters stay ordinary tensors.
        frozen_list, seen_frozen = [], set()
        for p in model.parameters():
            if not p.requires_grad and id(p) not in managed and id(p) not in seen_frozen:
                seen_frozen.add(id(p))
                frozen_list.append(p)
        frozen_ids = {id(p) for p in frozen_list}

        # Names, in model.named_parameters() order.
        names = {}
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
        for p in params:
            if id(p) not in names:
                raise ValueError(
                    "strata.initialize: model_parameters holds a tensor that is not a parameter of "
                    "the model"
                )
            if p.dtype != torch.float32:
                raise ValueError(
                    f"strata.initialize: parameter {names[id(p)]} is {p.dtype}; pass an fp32 model "
                    f"(the config's fp16/bf16 sections choose the working precision)"
                )
            if p.is_sparse:
                raise ValueError(f"strata.initialize: parameter {names[id(p)]} is sparse")

        # Blocks.
        if blocks is None:
            block_list = _default_blocks(model, managed)
        else:
            block_list = list(blocks)
            all_modules = {id(m) for m in model.modules()}
            for b in block_list:
                if not isinstance(b, torch.nn.Module) or id(b) not in all_modules:
                    raise ValueError(
                        "strata.initialize: every entry of blocks must be a submodule of the model"
                    )
            if len({id(b) for b in block_list}) != len(block_list):
                raise ValueError("strata.initialize: a module is listed twice in blocks")
            for b in block_list:
                for inner in b.modules():
                    if inner is not b and any(inner is c for c in block_list):
                        raise ValueError("strata.initialize: blocks may not contain one another")
        module_names = {id(m): n for n, m in model.named_modules()}
        owner: Dict[int, List[int]] = collections.defaultdict(list)
        for k, b in enumerate(block_list):
            for p in b.parameters():
                if id(p) in managed or id(p) in frozen_ids:
                    owner[id(p)].append(k)

        self._groups: List[_Group] = [_Group(0, "root", None)]
        for k, b in enumerate(block_list):
            self._groups.append(_Group(k + 1, module_names.get(id(b), f"block{k}"), b))
        self._param_list: List[_Param] = []
        for p in params:
            ks = owner.get(id(p), [])
            g = self._groups[ks[0] + 1] if len(ks) == 1 else self._groups[0]
            entry = _Param(p, names[id(p)], meta_shapes.get(id(p)))
            entry.pgroup = group_of.get(id(p), 0) if group_of else 0
            g.params.append(entry)
            self._param_list.append(entry)
        for p in frozen_list:
            ks = owner.get(id(p), [])
            g = self._groups[ks[0] + 1] if len(ks) == 1 else self._groups[0]
            g.frozen_params.append(_Param(p, names[id(p)], meta_shapes.get(id(p))))
        # Blocks whose parameters all went to the root (tied) are dropped.
        kept = [self._groups[0]] + [g for g in self._groups[1:] if g.params or g.frozen_params]
        for g in list(kept):
            if g.frozen_params:
                c = _Group(0, g.name + ":frozen", None, frozen=True)
                c.params = g.frozen_params
                g.companion = c
                kept.append(c)
        for i, g in enumerate(kept):
            g.index = i
        self._groups = kept

        # Rendezvous: a process group the user already made is reused (its store, rank
        # and world size); otherwise torchrun's environment (one process without it).
        store = None
        rank, world_size, local_rank, local_world_size = 0, 1, 0, 1
        prefix = f"strata/engine{next(_engine_counter)}"
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
            rank, world_size = dist.get_rank(), dist.get_world_size()
            local_rank = int(os.environ.get("LOCAL_RANK", rank))
            local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            # The same prefix on every rank: the ranks' n-th engine.
        # torch.distributed's rank when it is initialized; else the engine's own (torchrun's
        # RANK, which the core reads, or 0).
        self._global_rank = rank if store is not None else None
        self._mp_rank, self._mp_world = 0, 1
        if mpu is not None:
            # Model parallelism (DeepSpeed's mpu): the engine's ranks are the data-parallel
            # group's; each such group (one per model-parallel rank) runs its own engine,
            # met under its own prefix in the default store.
            if store is None:
                raise RuntimeError(
                    "strata.initialize: an mpu needs torch.distributed initialized first "
                    "(its groups are torch.distributed process groups)"
                )
            dp_group = _mpu_call(mpu, "get_data_parallel_group")
            members = dist.get_process_group_ranks(dp_group)
            rank, world_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
            prefix += "/dp" + "-".join(str(r) for r in members)
            self._mp_rank = int(_mpu_call(mpu, "get_model_parallel_rank", "get_tensor_model_parallel_rank"))
            self._mp_world = int(
                _mpu_call(mpu, "get_model_parallel_world_size", "get_tensor_model_parallel_world_size")
            )
            if self._mp_world > 1 and float(_config_dict(config_text).get("gradient_clipping", 0) or 0) > 0:
                raise NotImplementedError(
                    "strata.initialize: gradient_clipping with model parallelism (an mpu of "
                    f"{self._mp_world} model-parallel ranks) is not implemented: the gradient norm "
                    "would span only the data-parallel group; set gradient_clipping to 0 or clip "
                    "with your own model-parallel norm"
                )
        # The compute device (strata.device), and what the engine does not manage follows
        # the model there.
        cfg = _config_dict(config_text)
        from . import checkpointing

        checkpointing._from_engine_config(cfg)  # strata.checkpointing follows this engine's config
        self.device = _compute_device(model, params, names, cfg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            with torch.no_grad():
                for b in model.buffers():
                    if b.device != self.device:
                        b.data = b.data.to(self.device)
                for p in model.parameters():
                    if id(p) not in managed and id(p) not in frozen_ids and p.device != self.device:
                        p.data = p.data.to(self.device)
            cuda_device = self.device.index
            compute_stream = torch.cuda.current_stream(self.device).cuda_stream
        else:
            cuda_device, compute_stream = -1, 0
        inits = []
        desc = []
        init = None
        for g in self._groups:
            entries = []
            for e in g.params:
                if e.meta:  # zeros (strata.zero.Init): strata.load_safetensors gives the values
                    entries.append((e.name, e.numel, 0, e.pgroup, "fp32"))
                    continue
                # The parameter's own memory when the core can read it (CPU, contiguous, fp32,
                # bf16 or fp16: it converts), else an fp32 host copy (a CUDA model, another
                # dtype): no copy of a CPU model, even of a bf16 frozen base.
                init = e.param.detach()
                if init.device.type != "cpu" or not init.is_contiguous() or init.dtype not in _DTYPE_NAMES:
                    init = init.to("cpu", torch.float32).contiguous()
                    inits.append(init)
                entries.append((e.name, e.numel, init.data_ptr() if e.numel else 0, e.pgroup, _DTYPE_NAMES[init.dtype]))
            desc.append((g.name, entries, g.frozen))
        self._core = _strata.EngineCore(
            config_text,
            desc,
            store,
            prefix,
            rank,
            world_size,
            local_rank,
            local_world_size,
            prefetch,
            True,
            timeout_s,
            cuda_device,
            compute_stream,
            [_core_group_options(g) for g in (param_groups or [])],
        )
        del inits, init  # the last parameter's tensor too: its memory goes with the model's
        dtype = self._core.dtype
        # The working dtype computes directly, on the CPU too (torch 2.x has fp16 and bf16
        # CPU kernels): parameters point straight at the gathered buffer.
        self._compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
        self._elem = torch.empty((), dtype=self._compute).element_size()

        # Every parameter gets an engine-side storage (its original memory is freed) and a
        # hook on its gradient accumulator.
        with torch.no_grad():
            for g in self._groups:
                for i, e in enumerate(g.params):
                    full = torch.empty(e.shape, dtype=self._compute, device=self.device)
                    storage = full.untyped_storage()
                    e.full = full
                    e.empty = torch.empty(0, dtype=self._compute, device=self.device).set_(
                        storage, 0, (0,), (1,)
                    )
                    e.cdata = _storage_impl(storage)
                    e.nbytes = e.numel * self._elem
                    e.param.data = full
                    e.param.grad = None
                    if not g.frozen:
                        e.acc = e.param.register_post_accumulate_grad_hook(self._make_grad_hook(g.index, i))
                self._empty(g)
        if self.device.type == "cuda":
            # The parameters' original memory went back to torch's cache: return it, the
            # engine's arena holds them now.
            torch.cuda.empty_cache()

        # Forward hooks on the blocks.
        for g in self._groups[1:]:
            if g.frozen:
                continue  # gathered with its owner
            self._handles.append(g.module.register_forward_pre_hook(self._make_pre_hook(g.index)))
            self._handles.append(g.module.register_forward_hook(self._make_post_hook(g.index)))

        base_lr = _config_lr(cfg)
        opt_groups = [
            dict(g, factor=g["lr"] / base_lr if "lr" in g and base_lr > 0 else 1.0)
            for g in (param_groups or [{"params": params}])
        ]
        self.optimizer = EngineOptimizer(self, opt_groups)
        self.lr_scheduler = EngineScheduler(self) if cfg.get("scheduler") else None
        # The root group is gathered from here (and after every step) to the end of backward.
        self._acquire(0, backward=False)

    # ------------------------------------------------------------------ groups

    def _point(self, g: _Group) -> None:
        addrs = self._core.full_buffer(g.index)
        for e, a in zip(g.params, addrs):
            _strata.set_storage_data(e.cdata, a, e.nbytes)
            e.param.data = e.full

    def _empty(self, g: _Group) -> None:
        for e in g.params:
            e.param.data = e.empty
            _strata.set_storage_data(e.cdata, 0, 0)

    def _acquire(self, index: int, backward: bool, begins_phase: bool = True) -> None:
        g = self._groups[index]
        if backward:
            pre = self._core.pre_backward
        else:
            if begins_phase:
                self._void_recovered = False  # the core's iteration_void() ends here too

            def pre(i):
                self._core.pre_forward(i, begins_phase)

        pre(index)
        if g.companion is not None:
            pre(g.companion.index)
        g.open += 1
        if g.open == 1:
            self._point(g)
            if g.companion is not None:
                self._point(g.companion)
        if backward:
            g.open_backward += 1

    def _release(self, index: int, backward: bool) -> None:
        g = self._groups[index]
        if backward:
            g.open_backward -= 1
        g.open -= 1
        if g.open == 0:
            self._empty(g)
            if g.companion is not None:
                self._empty(g.companion)
        post = self._core.post_backward if backward else self._core.post_forward
        if g.companion is not None:
            post(g.companion.index)
        post(index)

    def _abort_forward(self) -> None:
        """A forward raised: forward hooks do not run after an exception, so close the
        blocks it left gathered (the exception propagates; the engine stays usable)."""
        for g in self._groups[1:]:
            while g.open - g.open_backward > 0:
                self._release(g.index, backward=False)

    def _close_backward(self, index: int) -> None:
        while self._groups[index].open_backward > 0:
            self._release(index, backward=True)

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"strata: an earlier error left the engine unusable: {self._error}"
            ) from self._error

    def _note(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc

    def _recover_void(self) -> bool:
        """After a core call raised: when the core voided the iteration (a pipelined optimizer
        step with the states on NVMe failed, and the forward since read partly updated
        parameters), the core holds no group: forget this front end's holds, views and
        gradients, take the root group again and clear the kept error, so the caller can
        start the iteration again with a new forward. False (nothing changed) otherwise.
        Once per void (the core says so until the next forward begins): a later call in that
        window (the voided loss's backward again, which the core refuses before taking
        anything) only drops the gradients and the kept error."""
        if not self._core.iteration_void():
            return False
        for g in self._groups:
            g.arrived = 0
            for e in g.params:
                e.arrived = False
                e.param.grad = None
        self._backward_pending = False
        self._error = None
        if self._void_recovered:
            return True  # the root is held since the recovery
        self._void_recovered = True
        for g in self._groups:
            self._empty(g)
            g.open = 0
            g.open_backward = 0
        # Not the start of a forward: the core keeps refusing the voided backward until then.
        self._acquire(0, backward=False, begins_phase=False)
        return True

    @contextlib.contextmanager
    def _recovering(self):
        """Around a core call that may complete a failed pipelined update: its error
        propagates, after _recover_void when the core voided the iteration."""
        try:
            yield
        except BaseException:
            self._recover_void()
            raise

    # ------------------------------------------------------------------ hooks

    def _make_pre_hook(self, index: int):
        def hook(module, inputs):
            if _under_torch_compile():
                raise RuntimeError(_COMPILE_ERROR)
            self._check()
            if _in_backward():
                # Activation checkpointing's recompute (torch.utils.checkpoint): the block
                # runs again inside the backward pass. It is gathered as for its backward
                # (which follows at once); the release is the backward's: when its last
                # gradient arrives or the backward ends. The recompute may also be cut short
                # (the non-reentrant checkpoint stops it once it has what it needs, before
                # the post-hook), which leaves nothing open.
                self._acquire(index, backward=True)
                return self._wrap_inputs(index, inputs)
            if self._backward_pending:
                raise RuntimeError(
                    "strata: forward after backward() without step(): call engine.step() after "
                    "every engine.backward()"
                )
            self._acquire(index, backward=False)
            return self._wrap_inputs(index, inputs)

        return _eager(hook)

    def _wrap_inputs(self, index: int, inputs):
        """A block whose parameters are all frozen: its tensor inputs that require grad go
        through _PostBackward, which releases the block when their gradients are computed."""
        g = self._groups[index]
        if g.params or not torch.is_grad_enabled():
            return None
        pos = [k for k, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not pos:
            return None
        wrapped = _PostBackward.apply(self, index, *[inputs[k] for k in pos])
        out = list(inputs)
        for k, t in zip(pos, wrapped):
            out[k] = t
        return tuple(out)

    def _on_post_backward(self, index: int) -> None:
        try:
            if self._groups[index].open_backward > 0:
                self._close_backward(index)
        except BaseException as exc:
            self._note(exc)
            raise

    def _make_post_hook(self, index: int):
        def hook(module, inputs, output):
            if _in_backward():
                return output  # a recompute: released with the backward (the pre-hook)
            self._release(index, backward=False)
            if not torch.is_grad_enabled():
                return output
            leaves, spec = _pytree.tree_flatten(output)
            pos = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not pos:
                return output
            wrapped = _PreBackward.apply(self, index, *[leaves[k] for k in pos])
            for k, t in zip(pos, wrapped):
                leaves[k] = t
            return _pytree.tree_unflatten(leaves, spec)

        return _eager(hook)

    def _on_pre_backward(self, index: int) -> None:
        try:
            self._acquire(index, backward=True)
        except BaseException as exc:
            self._note(exc)
            raise

    def _make_grad_hook(self, index: int, i: int):
        def hook(param):
            try:
                self._on_gradient(index, i)
            except BaseException as exc:
                self._note(exc)
                raise

        return _eager(hook)

    def _on_gradient(self, index: int, i: int) -> None:
        g = self._groups[index]
        e = g.params[i]
        grad = e.param.grad
        if grad is None:
            return
        if grad.is_sparse:
            raise NotImplementedError(
                f"strata: sparse gradient of parameter {e.name} (use a dense embedding)"
            )
        grad = grad.contiguous()
        dtype = _DTYPE_NAMES.get(grad.dtype)
        if dtype is None:
            raise ValueError(f"strata: gradient of {e.name} has dtype {grad.dtype}")
        self._core.add_gradient(index, i, grad.data_ptr(), dtype)
        e.param.grad = None
        if not e.arrived:
            e.arrived = True
            g.arrived += 1
        # Every gradient of the block arrived: its backward is over (post-backward).
        if index != 0 and g.arrived == len(g.params) and g.open_backward > 0:
            self._close_backward(index)

    # ------------------------------------------------------------------ public API

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the model. Under torch.no_grad() this is an evaluation forward (the engine
        prefetches only what it uses and releases everything after it)."""
        self._check()
        if self._needs_load:
            raise RuntimeError(
                "strata: the model was built under strata.zero.Init: its parameters have no values "
                "yet; load them first with strata.load_safetensors(engine, path)"
            )
        if self._backward_pending:
            raise RuntimeError(
                "strata: forward after backward() without step(): call engine.step() after every "
                "engine.backward()"
            )
        if torch.is_grad_enabled():
            try:
                return self.module(*args, **kwargs)
            except BaseException:
                self._abort_forward()
                raise
        self._core.begin_forward_only()
        try:
            out = self.module(*args, **kwargs)
        except BaseException:
            self._abort_forward()
            raise
        finally:
            self._release(0, backward=False)
            with self._recovering():
                self._core.end_forward_only()
            self._acquire(0, backward=False)
        return out

    def backward(self, loss: torch.Tensor) -> None:
        """Scales the loss (loss scale / gradient_accumulation_steps), runs autograd and
        hands every gradient to the engine (reduce-scatter into the optimizer's shards)."""
        self._check()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("strata: engine.backward: the loss must be a tensor of one element")
        if not loss.requires_grad:
            raise ValueError(
                "strata: engine.backward: the loss does not require grad (computed under no_grad, or "
                "from no parameter)"
            )
        if self._backward_pending:
            raise RuntimeError(
                "strata: engine.backward called twice without step(): call engine.step() after every "
                "engine.backward()"
            )
        scaled = loss * self._core.loss_multiplier()
        try:
            scaled.backward()
        except BaseException as exc:
            # The core voided the iteration (the error says so): the engine stays usable.
            if not self._recover_void():
                self._note(exc)
            raise
        self._check()
        for g in self._groups[1:]:
            self._close_backward(g.index)
        for g in self._groups:
            g.arrived = 0
            for e in g.params:
                e.arrived = False
        self._release(0, backward=False)
        with self._recovering():
            self._core.end_backward()
        self._backward_pending = True

    def step(self) -> dict:
        """Call after every backward: applies CPU Adam at a gradient-accumulation boundary.
        Returns the outcome (boundary, applied, overflow, global_norm, clip_coef, lr,
        loss_scale, adam_step)."""
        self._check()
        if not self._backward_pending:
            self._core.step()  # raises the core's message for the misuse
            raise RuntimeError("strata: engine.step: the core stepped without a backward")
        out = self._core.step()
        self._backward_pending = False
        self._acquire(0, backward=False)
        return out

    def zero_grad(self) -> None:
        """Nothing to do: the engine frees every gradient as it arrives."""

    def get_lr(self) -> List[float]:
        """The learning rate of the next applied step, as a list (DeepSpeed's convention)."""
        return [self._core.lr()]

    def set_lr(self, lr: float) -> None:
        """Overrides the learning rate until the next applied step."""
        self._core.set_lr(float(lr))

    @property
    def loss_scale(self) -> float:
        return self._core.loss_scale()

    def is_gradient_accumulation_boundary(self) -> bool:
        return self._core.is_gradient_accumulation_boundary()

    @property
    def rank(self) -> int:
        return self._core.rank

    @property
    def world_size(self) -> int:
        return self._core.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank in torch.distributed's world (``rank`` is the engine's:
        the data-parallel group's under an mpu)."""
        return self._global_rank if self._global_rank is not None else self._core.rank

    def statistics(self) -> dict:
        """Tiers, fetches, collectives, optimizer counters, the phases' times (a dict;
        "summary" is the text)."""
        return self._core.stats()

    def enable_timeline(self, on: bool = True) -> None:
        """Records timed spans from now on (off by default): the phases (forward, backward,
        step), each block's forward and backward, every wait of the engine's thread, each
        all-gather and reduce-scatter from its issue to the end of the wait for it, and each
        CPU optimizer pass. ``timeline()`` returns them; docs/python.md."""
        self._check()
        self._core.enable_timeline(on)

    def timeline(self) -> List[dict]:
        """The spans recorded since the last call (and forgets them), in the order they
        ended: dicts of ``name``, ``lane`` ("phase", "compute", "wait", "comm",
        "optimizer"), ``start_us`` and ``duration_us`` (microseconds; the start since the
        engine was made), ``index`` (the group, or the sub-group of an optimizer pass; -1:
        none) and ``micro_step``. At most 2**20 are kept between calls."""
        self._check()
        return self._core.take_timeline()

    def write_trace(self, path: str, events: Optional[List[dict]] = None) -> None:
        """Writes spans (default: ``timeline()``) as Chrome/Perfetto trace-event JSON
        (chrome://tracing, ui.perfetto.dev), one row per lane, pid = this rank. The file
        appears whole or not at all."""
        self._check()
        self._core.write_chrome_trace(os.fspath(path), self.timeline() if events is None else events)

    def groups(self) -> List[dict]:
        """Each group's name, sizes and parameters (name, numel, offset) as the engine laid them out."""
        return [self._core.layout(g.index) for g in self._groups]

    def group_of(self, param: torch.nn.Parameter) -> int:
        for g in self._groups:
            for e in g.params:
                if e.param is param:
                    return g.index
        raise ValueError("strata: not a parameter managed by this engine")

    def full_buffer_addresses(self, group: int) -> List[int]:
        """The addresses of a gathered group's parameters in the engine's buffer."""
        return self._core.full_buffer(group)

    def gather_parameters(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Collective: every parameter's fp32 master value, by name (every rank gets all)."""
        self._check()
        values = {}
        for g in self._groups:
            layout = self._core.layout(g.index)
            flat = torch.empty(layout["numel"], dtype=torch.float32)
            with self._recovering():
                self._core.gather_master_params(g.index, flat.data_ptr(), layout["numel"])
            pos = 0
            for e in g.params:
                values[id(e.param)] = flat[pos : pos + e.numel].view(e.shape).clone()
                pos += e.numel
        out = collections.OrderedDict()
        for name, p in self.module.named_parameters():
            out[name] = values[id(p)] if id(p) in values else p.detach().to("cpu", torch.float32).clone()
        return out

    def load_safetensors(self, path: Union[str, os.PathLike]) -> None:
        """Collective: replaces the model's parameters with a safetensors file's, or the files
        an index JSON names (``model.safetensors.index.json``, as Hugging Face's
        ``save_pretrained`` writes sharded models). Names as in ``model.named_parameters()``
        (a tied parameter under any of its names); F32, F16, BF16 and F64 values. Each rank
        reads only the slices its shards hold, frozen parameters' too; floating-point buffers
        (which every rank keeps whole) are read whole and may be absent. A file that does
        not match the model (the missing, mismatched and extra names listed) or that some
        rank cannot read fails on every rank with nothing changed. Call it before training
        or right after ``step()``; the optimizer's states and the loss scale are kept."""
        self._check()
        if self._in_eval:
            raise RuntimeError("strata: engine.load_safetensors inside an evaluation forward")
        if self._backward_pending:
            raise RuntimeError("strata: engine.load_safetensors between backward() and step()")
        names = collections.defaultdict(list)
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names[id(p)].append(name)

        def aliases(name, t):
            return [n for n in names[id(t)] if n != name]

        params = [
            [(e.name, aliases(e.name, e.param), list(e.shape)) for e in g.params] for g in self._groups
        ]
        managed = {id(e.param) for g in self._groups for e in g.params}  # frozen ones too
        others, targets, seen = [], [], set()
        for name, p in self.module.named_parameters():
            if id(p) in managed or id(p) in seen:
                continue
            seen.add(id(p))
            others.append((name, aliases(name, p), list(p.shape), False))
            targets.append(p)
        for name, b in self.module.named_buffers():
            if b is None or not b.is_floating_point():
                continue
            others.append((name, [], list(b.shape), True))
            targets.append(b)

        def fill(k: int, address: int, numel: int) -> None:
            t = targets[k]
            if numel == 0:
                return
            src = torch.frombuffer((ctypes.c_float * numel).from_address(address), dtype=torch.float32)
            with torch.no_grad():
                t.copy_(src.view(t.shape))

        # The engine's pass ends inside the load; the root group is gathered again after it.
        self._release(0, backward=False)
        try:
            self._core.load_safetensors(os.fspath(path), params, others, fill)
        finally:
            self._acquire(0, backward=False)
        self._needs_load = False

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        self.module.eval()
        return self

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def _whole_tensors(self) -> List[tuple]:
        """What this front end keeps whole, by the blob name a checkpoint keeps it under:
        parameters it does not manage (requiring grad but left out of model_parameters; the
        same on every rank: rank 0's is saved) and buffers (each rank's own). Frozen
        parameters are in the engine's frozen groups."""
        managed = {id(e.param) for g in self._groups for e in g.params}
        out, seen = [], set()
        for name, p in self.module.named_parameters():
            if id(p) in managed or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((_FROZEN_BLOB + name, p))
        for name, b in self.module.named_buffers():
            if b is not None:
                out.append((_BUFFER_BLOB + name, b))
        return out

    def save_checkpoint(
        self,
        save_dir: Union[str, os.PathLike],
        tag: Optional[str] = None,
        client_state: Optional[Mapping[str, Any]] = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> str:
        """Collective: saves a checkpoint into ``save_dir/tag`` (tag None:
        ``global_step<N>``) and moves ``save_dir/latest`` to it; returns the tag's directory.
        Call it before training or right after ``step()``.

        It holds each rank's fp32 master parameters (its shards of the frozen ones too),
        Adam m and v, the step counts, loss scaler and schedule position; the parameters
        left out of ``model_parameters`` (rank 0's) and each rank's buffers; each rank's RNG
        states (torch's CPU generator, the CUDA device's, Python's
        ``random`` and, when imported, NumPy's); and ``client_state`` (this rank's; anything
        ``torch.load(weights_only=True)`` reads back: tensors, numbers, strings, lists,
        dicts). Atomic: a failed or killed save leaves the previous checkpoints and
        ``latest`` as they were (docs/checkpoints.md).

        ``exclude_frozen_parameters`` (DeepSpeed's name): leave the frozen parameters'
        values out (those the engine partitioned with requires_grad False: a LoRA run's
        base), so the checkpoint holds what trains, with a fingerprint of each frozen group.
        A load then keeps the frozen values the model has, and refuses them when they are not
        that base: build the model with the same base weights first."""
        self._check()
        if self._in_eval:
            raise RuntimeError("strata: engine.save_checkpoint inside an evaluation forward")
        if self._backward_pending:
            raise RuntimeError("strata: engine.save_checkpoint between backward() and step()")
        if not save_latest:
            raise ValueError(
                "strata: engine.save_checkpoint(save_latest=False) is not supported: `latest` "
                "always names the last complete save"
            )
        blobs = []
        for name, t in self._whole_tensors():
            dtype = _SAFETENSORS_DTYPES.get(t.dtype)
            if dtype is None:
                raise ValueError(
                    f"strata: engine.save_checkpoint: {name.split('module:', 1)[1]} is "
                    f"{t.dtype}, which a checkpoint cannot hold"
                )
            c = t.detach().to("cpu").contiguous()
            data = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
            blobs.append((name, dtype, list(c.shape), data))
        for name, data in _rng_states(self.device).items():
            blobs.append((name, "U8", [], data))
        buf = io.BytesIO()
        torch.save(dict(client_state or {}), buf)
        blobs.append(("client_state", "U8", [], buf.getvalue()))
        shapes = [[list(e.shape) for e in g.params] for g in self._groups]
        with self._recovering():
            return self._core.save_checkpoint(
                self._mp_dir(save_dir), tag or "", blobs, shapes, bool(exclude_frozen_parameters)
            )

    def _mp_dir(self, d: Union[str, os.PathLike]) -> str:
        """Under model parallelism each model-parallel rank's data-parallel group keeps its
        checkpoints in its own subdirectory ``mp_rank_NN`` (its shards are its own model)."""
        d = os.fspath(d)
        return os.path.join(d, f"mp_rank_{self._mp_rank:02d}") if self._mp_world > 1 else d

    def load_checkpoint(
        self,
        load_dir: Union[str, os.PathLike],
        tag: Optional[str] = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        missing_ok: bool = False,
        check_frozen_parameters: bool = True,
    ) -> tuple:
        """Collective: loads ``load_dir/tag`` (tag None: the one ``load_dir/latest`` names),
        saved on any number of ranks; returns ``(path, client_state)`` as DeepSpeed's does.

        Every rank first checks the manifest against the model (the missing, extra and
        mismatched names listed), the frozen parameters and buffers, and the CRC32C of
        everything it reads; a failure on any rank raises on every rank with nothing
        changed. ``load_optimizer_states=False``: a fresh optimizer (m = v = 0, step 0).
        ``load_lr_scheduler_states=False``: the schedule keeps its position.
        ``load_module_only``: the parameters and buffers only. ``missing_ok``: when
        ``load_dir`` holds no checkpoint at all (no ``latest``) and no tag is given, return
        ``(None, None)`` instead of raising FileNotFoundError (auto-resume).

        A checkpoint saved with ``exclude_frozen_parameters`` keeps the model's frozen values
        and checks them against its fingerprint of the saving run's base first: another base
        raises ValueError naming the groups, with nothing changed.
        ``check_frozen_parameters=False`` (the same on every rank) loads it onto this base
        anyway."""
        self._check()
        if self._in_eval:
            raise RuntimeError("strata: engine.load_checkpoint inside an evaluation forward")
        if self._backward_pending:
            raise RuntimeError("strata: engine.load_checkpoint between backward() and step()")
        load_dir = self._mp_dir(load_dir)
        if missing_ok and tag is None and not os.path.exists(os.path.join(load_dir, "latest")):
            # The same answer on every rank when load_dir is shared, as it must be.
            return None, None
        whole = self._whole_tensors()

        def check_blobs(saved: list) -> Optional[str]:
            have = {
                name: (dtype, list(shape))
                for name, dtype, shape in saved
                if name.startswith(_FROZEN_BLOB) or name.startswith(_BUFFER_BLOB)
            }
            missing, mismatched = [], []
            for name, t in whole:
                short = name.split("module:", 1)[1]
                if name not in have:
                    missing.append(short)
                    continue
                dtype, shape = have.pop(name)
                want = (_SAFETENSORS_DTYPES.get(t.dtype), list(t.shape))
                if (dtype, shape) != want:
                    mismatched.append(f"{short} (checkpoint {dtype} {shape}, model {want[0]} {want[1]})")
            extra = sorted(n.split("module:", 1)[1] for n in have)
            if not (missing or mismatched or extra):
                return None
            parts = ["the frozen parameters and buffers differ from the model's"]
            for what, names in (
                ("missing from the checkpoint", missing),
                ("in the checkpoint but not the model", extra),
                ("of another type or shape", mismatched),
            ):
                if names:
                    parts.append(f"{what}: " + ", ".join(names[:20]) + (", ..." if len(names) > 20 else ""))
            return "; ".join(parts)

        # The engine's pass ends inside the load; the root group is gathered again after it.
        self._release(0, backward=False)
        try:
            loaded = self._core.load_checkpoint(
                load_dir,
                tag or "",
                load_optimizer_states,
                load_lr_scheduler_states,
                load_module_only,
                bool(check_frozen_parameters),
                check_blobs,
            )
        finally:
            self._acquire(0, backward=False)
        blobs = {name: (dtype, shape, data) for name, dtype, shape, data in loaded["blobs"]}
        with torch.no_grad():
            for name, t in whole:
                _, _, data = blobs[name]
                if t.numel():
                    src = torch.frombuffer(bytearray(data), dtype=t.dtype).view(t.shape)
                    t.copy_(src)
        if not load_module_only:
            _set_rng_states(self.device, {n: b[2] for n, b in blobs.items() if n.startswith("rng:")})
        client_state = None
        if "client_state" in blobs:
            try:
                client_state = torch.load(io.BytesIO(blobs["client_state"][2]), weights_only=True)
            except Exception as exc:  # noqa: BLE001: the reason is passed on
                raise RuntimeError(
                    f"strata: engine.load_checkpoint: the client_state in {loaded['path']} cannot "
                    f"be read with torch.load(weights_only=True): {exc}"
                ) from exc
        self._needs_load = False
        return loaded["path"], client_state

    def close(self) -> None:
        """Removes the hooks and destroys the engine (the parameters stay empty)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for e in self._param_list:
            e.param.data = torch.empty(0, dtype=self._compute, device=self.device)
            _strata.set_storage_data(e.cdata, 0, 0)
            if e.acc is not None:
                e.acc.remove()
            e.acc = None
        self._core.close()


def _materialize_meta(model, params, groups, group_of):
    """Parameters on the meta device (built under strata.zero.Init) get CPU Parameters put in
    every module slot that held them: a trained one with no memory (the engine's storage
    replaces it; its initial value is zero until strata.load_safetensors fills it), and so
    does a frozen one (requires_grad False: the engine's frozen groups). Returns the
    parameters, groups and group_of with the new objects, and {id(new): shape} of those."""
    trained = {id(p) for p in params}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None and p.is_meta and not p.requires_grad:
                trained.add(id(p))  # frozen: partitioned too
    new_of = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new_of:
                data = torch.empty(0, dtype=p.dtype) if id(p) in trained else torch.zeros(p.shape, dtype=p.dtype)
                new_of[id(p)] = (p, torch.nn.Parameter(data, requires_grad=p.requires_grad))
            mod._parameters[name] = new_of[id(p)][1]
    for name, b in model.named_buffers():
        if b is not None and b.is_meta:
            raise ValueError(
                f"strata.initialize: buffer {name} is on the meta device; strata.zero.Init builds only "
                f"parameters there (a model built under torch.device('meta') has no buffer values)"
            )
    if not new_of:
        return params, groups, group_of, {}

    def swap(p):
        return new_of[id(p)][1] if id(p) in new_of else p

    params = [swap(p) for p in params]
    if groups:
        for g in groups:
            g["params"] = [swap(p) for p in g["params"]]
    if group_of:
        group_of = {id(new_of[k][1]) if k in new_of else k: v for k, v in group_of.items()}
    shapes = {id(new): tuple(old.shape) for old, new in new_of.values() if id(old) in trained}
    return params, groups, group_of, shapes


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
    alias); the optimizer and scheduler come from it (``optimizer`` and ``lr_scheduler``
    objects are refused). ``model_parameters``: the parameters to train (default: every
    parameter that requires grad), or torch.optim-style parameter groups (dicts with
    "params" and any of lr, weight_decay, betas, eps overriding the config's optimizer
    values; a group's lr follows the schedule in proportion); the others stay ordinary
    tensors. ``blocks``: the
    modules that become groups (default: see the module docstring). Rank and world size:
    an initialized torch.distributed process group (its store is reused), else torchrun's
    environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else one process.
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
    if optimizer is not None:
        raise NotImplementedError(
            "strata.initialize: a client optimizer is not supported; configure the config's optimizer "
            "section (Adam, AdamW and Lamb run on the CPU)"
        )
    if lr_scheduler is not None:
        raise NotImplementedError(
            "strata.initialize: a client lr_scheduler is not supported; configure the config's "
            "scheduler section"
        )
    if training_data is not None:
        raise NotImplementedError("strata.initialize: training_data is not supported; build the DataLoader yourself")
    compiled = _compiled_modules(model)
    if compiled:
        raise ValueError(f"{_COMPILE_ERROR} Compiled here: {', '.join(compiled[:5])}")
    text = _read_config(config)
    groups, group_of = None, None
    if model_parameters is None:
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        model_parameters = list(model_parameters)
        if model_parameters and isinstance(model_parameters[0], dict):
            params, groups, group_of = _param_groups(model_parameters)
        else:
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
    params, groups, group_of, meta_shapes = _materialize_meta(model, params, groups, group_of)
    engine = Engine(model, text, params, blocks, prefetch, timeout, groups, group_of, meta_shapes, mpu)
    return engine, engine.optimizer, None, engine.lr_scheduler


def load_safetensors(engine: Engine, path: Union[str, os.PathLike]) -> None:
    """``engine.load_safetensors(path)``: initial weights from safetensors files, each rank
    reading only its slices."""
    engine.load_safetensors(path)
