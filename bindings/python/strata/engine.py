"""strata.initialize: the ZeRO-3 engine for any torch.nn.Module, driven from Python.

A Python front end over the torch-free ``EngineCore`` (engine/runtime/engine_core.h) and
the hook protocol both front ends drive (engine/protocol/hook_protocol.h; the LibTorch
front end is engine/libtorch/): docs/python.md, "How the hooks work".

- groups (engine/protocol/groups.h): group 0 ("root") holds every managed parameter outside
  the blocks; groups 1.. are the blocks: by default the direct children of the model that
  have parameters, where containers (nn.Sequential, nn.ModuleList, nn.ModuleDict), and
  modules that hold one, are looked into, so each of their children that has parameters is
  a block (a Hugging Face LlamaForCausalLM: each decoder layer and the final norm); or the
  modules passed as ``blocks=``. A parameter shared by two blocks, or by a block and a
  module outside it (tied weights), goes to the root group. Frozen parameters
  (requires_grad False) form a frozen group beside their block's.
- parameter tensors share memory with the engine (strata/_hooks.py, ParameterTensors).
- forward pre/post hooks on each block call the protocol's begin_forward and end_forward;
  an autograd Function around the block's outputs calls pre_backward before its gradient
  functions run; post-accumulate-grad hooks on each parameter hand the gradient to the
  protocol and free it. The root group is gathered from initialize/step() to the end of
  backward().
"""

from __future__ import annotations

import collections
import contextlib
import copy
import ctypes
import io
import itertools
import json
import logging
import os
import random
import sys
import weakref
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import torch
from torch.utils import _pytree

from . import _hooks, _setup, _strata

__all__ = ["initialize", "load_safetensors", "Engine", "EngineOptimizer", "EngineScheduler"]

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_engine_counter = itertools.count()
# Checkpoint blob names, the same for both front ends (engine/checkpoint/blobs.h).
_BLOB = _strata.BLOB_NAMES
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
    out = {_BLOB["torch_cpu_rng"]: torch.get_rng_state().numpy().tobytes()}
    if device.type == "cuda":
        out[_BLOB["torch_cuda_rng"]] = torch.cuda.get_rng_state(device).numpy().tobytes()
    version, state, gauss = random.getstate()
    out[_BLOB["python_rng"]] = json.dumps([version, list(state), gauss]).encode()
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out[_BLOB["numpy_rng"]] = json.dumps([name, keys.tolist(), pos, has_gauss, cached]).encode()
    return out


def _set_rng_states(device: torch.device, blobs: Dict[str, bytes]) -> None:
    def state(key):
        return torch.frombuffer(bytearray(blobs[_BLOB[key]]), dtype=torch.uint8)

    if _BLOB["torch_cpu_rng"] in blobs:
        torch.set_rng_state(state("torch_cpu_rng"))
    if device.type == "cuda" and _BLOB["torch_cuda_rng"] in blobs:
        torch.cuda.set_rng_state(state("torch_cuda_rng"), device)
    if _BLOB["python_rng"] in blobs:
        version, st, gauss = json.loads(blobs[_BLOB["python_rng"]])
        random.setstate((version, tuple(st), gauss))
    np = sys.modules.get("numpy")
    if np is not None and _BLOB["numpy_rng"] in blobs:
        name, keys, pos, has_gauss, cached = json.loads(blobs[_BLOB["numpy_rng"]])
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _logger() -> logging.Logger:
    """The ``strata`` logger: rank 0's progress lines (``steps_per_print``). Given a handler
    to stderr at INFO the first time, as DeepSpeed's logger has one, unless the user gave it
    handlers or a level first; set its level (``logging.getLogger("strata").setLevel(
    logging.WARNING)``) to quiet it."""
    log = logging.getLogger("strata")
    if not log.handlers and not getattr(log, "_strata_configured", False):
        log._strata_configured = True
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[strata] %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
    return log


def _profiler_range(name: str):
    """A named range in torch.profiler's trace (``record_function``) while the profiler runs
    on this thread; nothing otherwise."""
    if torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def _whole_entries(verb: str, tensors: List[tuple]) -> tuple:
    """What a model save writes whole from rank 0 (buffers, parameters the engine does not
    manage): ``(entries, keep)``, entries ``(name, safetensors dtype, shape, address)`` of
    contiguous CPU copies that ``keep`` holds alive for the call."""
    entries, keep = [], []
    for name, t in tensors:
        dtype = _SAFETENSORS_DTYPES.get(t.dtype)
        if dtype is None:
            raise ValueError(f"strata: engine.{verb}: {name} is {t.dtype}, which safetensors cannot hold")
        c = t.detach().to("cpu").contiguous()
        keep.append(c)
        entries.append((name, dtype, list(c.shape), c.data_ptr() if c.numel() else 0))
    return entries, keep


def _is_peft_model(model: torch.nn.Module) -> bool:
    """A PEFT model (peft.PeftModel and its task subclasses): checked without importing
    peft into processes that never use it."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def _adapter_config_json(model, adapter: str) -> str:
    """adapter_config.json as ``PeftModel.save_pretrained`` writes it (peft 0.21: the config
    in inference mode, the base model's name, the auto mapping of a config without a task
    type; sets as sorted lists, keys sorted, indent 2)."""
    config = copy.deepcopy(model.peft_config[adapter])
    if config.base_model_name_or_path is None:
        base = model.base_model if config.is_prompt_learning else model.base_model.model
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    out = config.to_dict()
    for key, value in out.items():
        if isinstance(value, set):
            # Sorted: peft writes a set in its (copied) set's iteration order, which depends on
            # the process's string hash seed; a sorted list is the same set, every run.
            out[key] = sorted(value, key=str)
    if config.task_type is None:
        base_class = model._get_base_model_class(is_prompt_tuning=config.is_prompt_learning)
        out["auto_mapping"] = {"base_model_class": base_class.__name__, "parent_library": base_class.__module__}
    return json.dumps(out, indent=2, sort_keys=True)


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
        self._self_ref = weakref.ref(self)
        self._gathered_open = 0  # strata.zero.GatheredParameters contexts open on this engine
        meta_shapes = meta_shapes or {}
        # Built under strata.zero.Init: no values until strata.load_safetensors.
        self._needs_load = bool(meta_shapes)
        self._handles = []
        self._ranges = []  # torch.profiler ranges of the blocks whose forward runs
        cfg = _setup.config_dict(config_text)
        names = self._check_parameters(params)
        self._plan_groups(params, blocks, names, meta_shapes, group_of)
        (store, prefix, rank, world_size, local_rank, local_world_size, self._global_rank, self._mp_rank,
         self._mp_world) = _setup.rendezvous(mpu, config_text, next(_engine_counter))
        from . import checkpointing

        checkpointing._from_engine_config(cfg)  # strata.checkpointing follows this engine's config
        self.device = _setup.compute_device(model, params, names, cfg)
        cuda_device, compute_stream = self._to_device()
        desc, inits = self._describe_groups()
        self._core = _strata.EngineCore(
            config_text, desc, store, prefix, rank, world_size, local_rank, local_world_size, prefetch,
            True, timeout_s, cuda_device, compute_stream,
            [_setup.core_group_options(g) for g in (param_groups or [])],
        )
        del inits, desc  # the initial values' copies: their memory goes with the model's
        tensors = _hooks.ParameterTensors(self._groups)
        self._bind_tensors(tensors)
        # The root group is gathered from here (and after every step) to the end of backward.
        self._core.start_hooks([(len(g.params), g.frozen, g.companion) for g in self._groups], tensors)
        for g in self._groups:
            if g.module is not None:
                self._handles.append(
                    g.module.register_forward_pre_hook(self._make_pre_hook(g.index), with_kwargs=True)
                )
                self._handles.append(g.module.register_forward_hook(self._make_post_hook(g.index)))
        base_lr = _setup.config_lr(cfg)
        opt_groups = [
            dict(g, factor=g["lr"] / base_lr if "lr" in g and base_lr > 0 else 1.0)
            for g in (param_groups or [{"params": params}])
        ]
        self.optimizer = EngineOptimizer(self, opt_groups)
        self.lr_scheduler = EngineScheduler(self) if cfg.get("scheduler") else None
        # steps_per_print (DeepSpeed's): rank 0 logs a progress line every so many optimizer
        # steps through the "strata" logger; 0 or less: never.
        self._steps_per_print = int(cfg.get("steps_per_print", 10))
        self._betas = tuple((cfg.get("optimizer") or {}).get("params", {}).get("betas", (0.9, 0.999)))
        self._global_steps = 0
        # DeepSpeed's monitors (csv_monitor, tensorboard, wandb): strata/monitor.py.
        from .monitor import Monitor

        full = json.loads(self._core.normalized_config)
        self._monitor = Monitor(
            full, self.global_rank, fp16=bool(full.get("fp16", {}).get("enabled")),
            train_batch_size=int(full["train_batch_size"]),
            params=sum(e.numel for g in self._groups for e in g.params),
        )

    # ------------------------------------------------------------------ set-up

    def _check_parameters(self, params) -> Dict[int, str]:
        """Every trained parameter is the model's, floating (fp32, bf16 or fp16: the fp32
        master is made from its values shard by shard, so a bf16 model's master starts at
        bf16 precision) and dense; returns {id: first name}."""
        names = {}
        for name, p in self.module.named_parameters():
            names.setdefault(id(p), name)
        for p in params:
            if id(p) not in names:
                raise ValueError(
                    "strata.initialize: model_parameters holds a tensor that is not a parameter of the model"
                )
            if p.dtype not in _DTYPE_NAMES:
                raise ValueError(
                    f"strata.initialize: parameter {names[id(p)]} is {p.dtype}; the engine trains "
                    f"fp32, bf16 and fp16 parameters (cast the model with model.to(torch.bfloat16), "
                    f"say; the config's fp16/bf16 sections choose the working precision)"
                )
            if p.is_sparse:
                raise ValueError(f"strata.initialize: parameter {names[id(p)]} is sparse")
        return names

    def _plan_groups(self, params, blocks, names, meta_shapes, group_of) -> None:
        """The engine's groups (engine/protocol/groups.h) from the blocks: the trained
        parameters, and the frozen ones (the model's requires_grad-False parameters not given
        to train: partitioned and gathered like the rest, in frozen groups, with no optimizer
        state, gradient or weight decay). Parameters that require grad but were left out of
        model_parameters stay ordinary tensors."""
        managed = {id(p) for p in params}
        frozen, seen = [], set()
        for p in self.module.parameters():
            if not p.requires_grad and id(p) not in managed and id(p) not in seen:
                seen.add(id(p))
                frozen.append(p)
        self._managed = managed | seen
        block_list = _setup.default_blocks(self.module, self._managed) if blocks is None else _setup.check_blocks(
            self.module, blocks
        )
        module_names = {id(m): n for n, m in self.module.named_modules()}
        block_names = [module_names.get(id(b), f"block{k}") for k, b in enumerate(block_list)]
        entries = [(p, names[id(p)], True) for p in params] + [(p, names[id(p)], False) for p in frozen]
        planned = _strata.plan_groups(block_names, _setup.placements(self.module, block_list, block_names, entries))
        self._groups: List[_hooks.Group] = []
        for i, g in enumerate(planned):
            members = [
                _hooks.Param(entries[k][0], entries[k][1], meta_shapes.get(id(entries[k][0])),
                             (group_of or {}).get(id(entries[k][0]), 0) if entries[k][2] else 0)
                for k in g["params"]
            ]
            module = block_list[g["block"]] if g["block"] >= 0 else None
            self._groups.append(_hooks.Group(i, g["name"], module, members, g["frozen"], g["companion"]))

    def _to_device(self) -> tuple:
        """On CUDA, what the engine does not manage follows the model to the device; returns
        (CUDA device index or -1, the compute stream or 0)."""
        if self.device.type != "cuda":
            return -1, 0
        torch.cuda.set_device(self.device)
        with torch.no_grad():
            for b in self.module.buffers():
                if b.device != self.device:
                    b.data = b.data.to(self.device)
            for p in self.module.parameters():
                if id(p) not in self._managed and p.device != self.device:
                    p.data = p.data.to(self.device)
        return self.device.index, torch.cuda.current_stream(self.device).cuda_stream

    def _follow_stream(self) -> None:
        """On CUDA, the current stream becomes the engine's compute stream (a forward under
        a user's ``torch.cuda.stream(...)`` has the engine's events on that stream)."""
        if self.device.type == "cuda":
            self._core.use_compute_stream(torch.cuda.current_stream(self.device).cuda_stream)

    def _describe_groups(self) -> tuple:
        """The groups as the core takes them, with the initial values: the parameter's own
        memory when the core can read it (CPU, contiguous, fp32, bf16 or fp16: it converts
        to fp32 piece by piece, for this rank's shard only), else a contiguous host copy in
        the parameter's dtype (a CUDA model's, until the engine has taken its shards): no
        rank makes an fp32 copy of the model. Parameters built under strata.zero.Init are zeros until
        strata.load_safetensors gives their values."""
        desc, inits = [], []
        for g in self._groups:
            entries = []
            for e in g.params:
                if e.meta:
                    entries.append((e.name, e.numel, 0, e.pgroup, "fp32"))
                    continue
                init = e.param.detach()
                if init.device.type != "cpu" or not init.is_contiguous():
                    init = init.to("cpu").contiguous()
                    inits.append(init)
                entries.append((e.name, e.numel, init.data_ptr() if e.numel else 0, e.pgroup, _DTYPE_NAMES[init.dtype]))
            desc.append((g.name, entries, g.frozen))
        return desc, inits

    def _bind_tensors(self, tensors: _hooks.ParameterTensors) -> None:
        """Every parameter gets an engine-side storage (its original memory is freed) and a
        hook on its gradient accumulator. The working dtype computes directly, on the CPU
        too (torch 2.x has fp16 and bf16 CPU kernels): parameters point straight at the
        gathered buffer."""
        self._compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self._core.dtype, torch.float32)
        with torch.no_grad():
            for g in self._groups:
                for i, e in enumerate(g.params):
                    _hooks.bind(e, self._compute, self.device)
                    # How strata.zero.GatheredParameters finds the engine of a parameter.
                    e.param._strata_ref = (self._self_ref, g.index, i)
                    if not g.frozen:
                        e.acc = e.param.register_post_accumulate_grad_hook(self._make_grad_hook(g.index, i))
                tensors.empty(g.index)
        if self.device.type == "cuda":
            # The parameters' original memory went back to torch's cache: return it, the
            # engine's arena holds them now.
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ hooks

    def _make_pre_hook(self, index: int):
        def hook(module, args, kwargs):
            if _hooks.under_torch_compile():
                raise RuntimeError(_hooks.COMPILE_ERROR)
            # In a backward: activation checkpointing's recompute (torch.utils.checkpoint),
            # gathered as for its backward, which follows at once; released with it (its
            # last gradient, or the backward's end). The non-reentrant checkpoint may cut the
            # recompute short, before the post-hook: nothing is left open.
            recompute = _hooks.in_backward()
            if not recompute and torch.autograd._profiler_enabled():
                # The block's forward as a torch.profiler range (its gather included),
                # named as Strata's own trace names it; closed by the post-hook.
                r = torch.autograd.profiler.record_function(f"strata::forward {self._groups[index].name}")
                r.__enter__()
                self._ranges.append(r)
            self._follow_stream()
            self._core.begin_forward(index, recompute)
            return self._wrap_inputs(index, recompute, args, kwargs)

        return _hooks.eager(hook)

    def _wrap_inputs(self, index: int, recompute: bool, args, kwargs):
        """A block with frozen parameters: its tensor inputs (positional or keyword, in
        containers too) that require grad go through PostBackward, which tells the protocol
        when their gradients are computed; its backward is over then and once its trainable
        gradients arrived (engine/protocol/hook_protocol.h: a LoRA adapter's gradients may
        all arrive before autograd has used the frozen weight for the input's gradient)."""
        g = self._groups[index]
        if not torch.is_grad_enabled() or (g.companion < 0 and not g.frozen):
            return None  # no frozen parameter (the protocol's ExpectInputs says the same)
        leaves, spec = _pytree.tree_flatten((args, kwargs))
        pos = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not pos or not self._core.expect_inputs(index, recompute):
            return None
        wrapped = _hooks.PostBackward.apply(self._core, index, *[leaves[k] for k in pos])
        for k, t in zip(pos, wrapped):
            leaves[k] = t
        return _pytree.tree_unflatten(leaves, spec)

    def _make_post_hook(self, index: int):
        def hook(module, inputs, output):
            if _hooks.in_backward():
                return output  # a recompute: released with the backward (the pre-hook)
            try:
                self._core.end_forward(index, False)
            finally:
                if self._ranges:
                    self._close_range(f"strata::forward {self._groups[index].name}")
            if not torch.is_grad_enabled():
                return output
            leaves, spec = _pytree.tree_flatten(output)
            pos = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
            if not pos:
                return output
            wrapped = _hooks.PreBackward.apply(self._core, index, *[leaves[k] for k in pos])
            for k, t in zip(pos, wrapped):
                leaves[k] = t
            return _pytree.tree_unflatten(leaves, spec)

        return _hooks.eager(hook)

    def _make_grad_hook(self, index: int, i: int):
        e = self._groups[index].params[i]

        def hook(param):
            grad = param.grad
            if grad is None:
                return
            if grad.is_sparse:
                raise NotImplementedError(f"strata: sparse gradient of parameter {e.name} (use a dense embedding)")
            grad = grad.contiguous()
            dtype = _DTYPE_NAMES.get(grad.dtype)
            if dtype is None:
                raise ValueError(f"strata: gradient of {e.name} has dtype {grad.dtype}")
            if grad.is_cuda:
                # LibTorch's allocator reuses the gradient only after the current stream's
                # work, which the engine's read is part of.
                self._core.use_compute_stream(torch.cuda.current_stream(grad.device).cuda_stream)
                self._core.gradient(index, i, grad.data_ptr(), dtype)
            else:
                # The CPU device reads it on its compute stream's worker: kept until then.
                self._core.gradient(index, i, grad.data_ptr(), dtype, grad)
            param.grad = None

        return _hooks.eager(hook)

    def _close_range(self, name: str) -> None:
        """Closes the innermost open block range of that name (the profiler may have
        stopped since it opened: the range is closed all the same)."""
        for k in range(len(self._ranges) - 1, -1, -1):
            if self._ranges[k].name == name:
                self._ranges.pop(k).__exit__(None, None, None)
                return

    def _abort_forward(self) -> None:
        """A forward raised: forward hooks do not run after an exception; the protocol
        closes the blocks it left gathered (an error of its own is kept and reported by the
        next call: the forward's exception propagates)."""
        while self._ranges:  # the block ranges a raising forward left open
            self._ranges.pop().__exit__(None, None, None)
        try:
            self._core.abort_forward()
        except Exception:  # noqa: BLE001: kept by the protocol, raised by the next call
            pass

    # ------------------------------------------------------------------ public API

    def __getattr__(self, name: str):
        """What the engine does not have falls through to the model (DeepSpeed's engine does
        the same): ``engine.config`` of a transformers model, say."""
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(module, name)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the model. Under torch.no_grad() this is an evaluation forward (the engine
        prefetches only what it uses and releases everything after it)."""
        self._core.check_forward()
        if self._gathered_open:
            raise RuntimeError(
                "strata: a forward inside strata.zero.GatheredParameters: leave the context first "
                "(the engine gathers what a forward uses by itself)"
            )
        if self._needs_load:
            raise RuntimeError(
                "strata: the model was built under strata.zero.Init: its parameters have no values "
                "yet; load them first with strata.load_safetensors(engine, path)"
            )
        if torch.is_grad_enabled():
            self._monitor.record_forward(args, kwargs)
            with _profiler_range("strata::forward"):
                try:
                    return self.module(*args, **kwargs)
                except BaseException:
                    self._abort_forward()
                    raise
        with _profiler_range("strata::forward (no backward)"):
            self._core.begin_eval()
            try:
                return self.module(*args, **kwargs)
            except BaseException:
                self._abort_forward()
                raise
            finally:
                self._core.end_eval()

    def backward(self, loss: torch.Tensor) -> None:
        """Scales the loss (loss scale / gradient_accumulation_steps), runs autograd and
        hands every gradient to the engine (reduce-scatter into the optimizer's shards)."""
        self._follow_stream()
        self._core.begin_backward()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("strata: engine.backward: the loss must be a tensor of one element")
        if not loss.requires_grad:
            raise ValueError(
                "strata: engine.backward: the loss does not require grad (computed under no_grad, or "
                "from no parameter)"
            )
        self._monitor.record_loss(loss)
        scaled = loss * self._core.loss_multiplier()
        with _profiler_range("strata::backward"):
            try:
                scaled.backward()
            except BaseException as exc:
                # A hook's error kept in this backward is raised instead (a voided iteration is
                # recovered first: the engine stays usable); else autograd's, kept.
                self._core.autograd_failed(f"{type(exc).__name__}: {exc}")
                raise
            self._core.finish_backward()

    def step(self) -> dict:
        """Call after every backward: applies CPU Adam at a gradient-accumulation boundary.
        Returns the outcome (boundary, applied, overflow, global_norm, clip_coef, lr,
        loss_scale, adam_step). Every ``steps_per_print`` optimizer steps rank 0 logs
        DeepSpeed's progress line (``step=N, skipped=S, lr=[...], mom=[...]``) through the
        ``strata`` logger."""
        with _profiler_range("strata::step"):
            out = self._core.step()
        if out["boundary"]:
            self._global_steps += 1
            every = self._steps_per_print
            if every > 0 and self._global_steps % every == 0 and self._core.rank == 0:
                _logger().info(
                    "[Rank 0] step=%d, skipped=%d, lr=%s, mom=%s",
                    self._global_steps, self._core.skipped_steps(), [out["lr"]], [self._betas],
                )
            self._monitor.record_step(self._global_steps, out, self._core.stats)
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
        self._core.check_usable()
        self._core.enable_timeline(on)

    def timeline(self) -> List[dict]:
        """The spans recorded since the last call (and forgets them), in the order they
        ended: dicts of ``name``, ``lane`` ("phase", "compute", "wait", "comm",
        "optimizer"), ``start_us`` and ``duration_us`` (microseconds; the start since the
        engine was made), ``index`` (the group, or the sub-group of an optimizer pass; -1:
        none) and ``micro_step``. At most 2**20 are kept between calls."""
        self._core.check_usable()
        return self._core.take_timeline()

    def write_trace(self, path: str, events: Optional[List[dict]] = None) -> None:
        """Writes spans (default: ``timeline()``) as Chrome/Perfetto trace-event JSON
        (chrome://tracing, ui.perfetto.dev), one row per lane, pid = this rank. The file
        appears whole or not at all."""
        self._core.check_usable()
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

    def _gather_params(self, refs: List[tuple]) -> Dict[tuple, torch.Tensor]:
        """Collective: the fp32 master values of the parameters ``refs`` ((group, index),
        the same list on every rank), gathered a group at a time."""
        wanted = set(refs)
        out = {}
        for g in sorted({g for g, _ in refs}):
            layout = self._core.layout(g)
            flat = torch.empty(layout["numel"], dtype=torch.float32)
            self._core.gather_master_params(g, flat.data_ptr(), layout["numel"])
            pos = 0
            for i, e in enumerate(self._groups[g].params):
                if (g, i) in wanted:
                    out[(g, i)] = flat[pos : pos + e.numel].view(e.shape).clone()
                pos += e.numel
        return out

    def _param_entry(self, g: int, i: int) -> _hooks.Param:
        return self._groups[g].params[i]

    def gather_parameters(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Collective: every parameter's fp32 master value, by name (every rank gets all)."""
        values = {}
        for g in self._groups:
            layout = self._core.layout(g.index)
            flat = torch.empty(layout["numel"], dtype=torch.float32)
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
        names = collections.defaultdict(list)
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names[id(p)].append(name)

        def aliases(name, t):
            return [n for n in names[id(t)] if n != name]

        params = [[(e.name, aliases(e.name, e.param), list(e.shape)) for e in g.params] for g in self._groups]
        others, targets, seen = [], [], set()
        for name, p in self.module.named_parameters():
            if id(p) in self._managed or id(p) in seen:
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

        # At a step boundary; the engine's pass ends inside the load (engine/protocol).
        self._core.load_safetensors(os.fspath(path), params, others, fill)
        self._needs_load = False

    def _saved_names(self, exclude_frozen_parameters: bool) -> Dict[int, str]:
        """{id(tensor): the name the model is saved under}: ``state_dict()``'s names and
        order, each tensor once (tied weights: the name ``save_pretrained`` keeps, not the
        one a transformers model lists as tied to another), non-persistent buffers left out,
        frozen parameters too when asked."""
        tied = getattr(self.module, "_tied_weights_keys", None)
        tied_targets = set(tied) if isinstance(tied, (dict, list, tuple, set)) else set()
        frozen = {id(e.param) for g in self._groups if g.frozen for e in g.params}
        names: Dict[int, List[str]] = collections.OrderedDict()
        for name, t in self.module.state_dict(keep_vars=True).items():
            names.setdefault(id(t), []).append(name)
        out = {}
        for key, candidates in names.items():
            if exclude_frozen_parameters and key in frozen:
                continue
            kept = [n for n in candidates if n not in tied_targets] or candidates
            out[key] = kept[0]
        return out

    def save_16bit_model(
        self,
        save_dir: Union[str, os.PathLike],
        save_filename: str = "model.safetensors",
        max_shard_size: Union[int, str] = "5GB",
        exclude_frozen_parameters: bool = False,
        _files: Sequence[tuple] = (),
    ) -> dict:
        """Collective: writes the model's weights in Hugging Face's layout into ``save_dir``
        (DeepSpeed's name): safetensors files in the working dtype (bf16, fp16, or fp32
        without a half-precision section), ``model.state_dict()``'s names (tied weights once,
        as ``save_pretrained`` writes them), sharded with a ``model.safetensors.index.json``
        when larger than ``max_shard_size`` (bytes, or "5GB", "500MB", "2GiB").

        Streamed: every rank gathers one group at a time and rank 0 converts and writes it,
        so no rank holds the model (the memory is about 3 fp32 copies of the largest group:
        the result's ``gather_bytes``). Parameters the engine does not manage and persistent
        buffers are rank 0's. Atomic per file set: a failure on any rank raises on every rank
        and leaves ``save_dir`` as it was. ``exclude_frozen_parameters``: the frozen ones
        left out (a LoRA run's base). Returns {files, index, tensors, tensor_bytes,
        file_bytes, gather_bytes} (the file fields filled on rank 0)."""
        if not save_filename.endswith(".safetensors"):
            raise ValueError(
                f"strata: engine.save_16bit_model: save_filename {save_filename!r} must end in "
                f".safetensors (Strata writes safetensors, not pickles)"
            )
        limit = _strata.parse_bytes(str(max_shard_size)) if isinstance(max_shard_size, str) else int(max_shard_size)
        if limit <= 0:
            raise ValueError(f"strata: engine.save_16bit_model: max_shard_size must be positive, got {max_shard_size!r}")
        saved = self._saved_names(bool(exclude_frozen_parameters))
        params = [[(saved.get(id(e.param), ""), list(e.shape)) for e in g.params] for g in self._groups]
        managed = {id(e.param) for g in self._groups for e in g.params}
        whole, keep = _whole_entries(
            "save_16bit_model",
            [(name, t) for name, t in self.module.state_dict(keep_vars=True).items()
             if id(t) not in managed and saved.get(id(t)) == name],
        )
        return self._core.save_model(os.fspath(save_dir), save_filename, limit, params, whole, list(_files), "")

    def save_pretrained(
        self,
        save_directory: Union[str, os.PathLike],
        max_shard_size: Union[int, str] = "5GB",
        safe_serialization: bool = True,
        exclude_frozen_parameters: bool = False,
        **kwargs,
    ) -> dict:
        """Collective: the model as transformers' ``save_pretrained`` writes it, so that
        ``AutoModelForCausalLM.from_pretrained(save_directory)`` loads it: the weights as
        ``save_16bit_model`` writes them (``model.safetensors``, sharded past
        ``max_shard_size``) and, from rank 0, the model's ``config.json`` and (for a model that
        generates) ``generation_config.json``, committed with the weights (a failed save
        leaves none of them). For a transformers model only (a
        ``PreTrainedModel``); another model: ``save_16bit_model``."""
        if not safe_serialization:
            raise ValueError("strata: engine.save_pretrained(safe_serialization=False): Strata writes safetensors only")
        if _is_peft_model(self.module):
            return self._save_adapters(save_directory, **kwargs)
        unknown = set(kwargs) - {"is_main_process", "push_to_hub", "variant", "token", "save_function", "state_dict"}
        if unknown:
            raise TypeError(f"strata: engine.save_pretrained: unexpected arguments {sorted(unknown)}")
        for key in ("push_to_hub", "variant", "save_function", "state_dict"):
            if kwargs.get(key):
                raise ValueError(
                    f"strata: engine.save_pretrained({key}=...) is not supported: the engine writes "
                    f"its own gathered weights into a local directory"
                )
        config = getattr(self.module, "config", None)
        if config is None or not hasattr(config, "save_pretrained"):
            raise TypeError(
                f"strata: engine.save_pretrained: {type(self.module).__name__} is not a transformers "
                f"model (it has no config to write); use engine.save_16bit_model(save_dir)"
            )
        # config.json as save_pretrained writes it (the architecture, the dtype of the saved
        # weights), written with the weights by rank 0: all of it or none.
        config = copy.deepcopy(config)
        config.architectures = [type(self.module).__name__]
        config.dtype = str(self._compute).split(".")[1]
        files = [("config.json", config.to_json_string(use_diff=True))]
        gen = getattr(self.module, "generation_config", None)
        if gen is not None and getattr(self.module, "can_generate", lambda: False)():
            files.append(("generation_config.json", gen.to_json_string(use_diff=True)))
        return self.save_16bit_model(
            save_directory, "model.safetensors", max_shard_size, exclude_frozen_parameters, _files=files
        )

    def _save_adapters(
        self,
        save_directory: Union[str, os.PathLike],
        selected_adapters: Optional[Sequence[str]] = None,
        save_embedding_layers: Union[str, bool] = "auto",
        is_main_process: bool = True,
        **kwargs,
    ) -> dict:
        """save_pretrained of a PEFT model: what ``PeftModel.save_pretrained`` writes, so that
        ``PeftModel.from_pretrained(base, save_directory)`` loads it: for each adapter (in
        ``save_directory``, or its own subdirectory for an adapter not named "default") the
        weights PEFT's ``get_peft_model_state_dict`` picks, under its names, in
        ``adapter_model.safetensors`` (in the working dtype), and ``adapter_config.json``,
        committed together by rank 0 (a failed save leaves neither). Collective."""
        from peft.utils import get_peft_model_state_dict

        unknown = set(kwargs) - {"push_to_hub", "token", "state_dict", "path_initial_model_for_weight_conversion"}
        if unknown:
            raise TypeError(f"strata: engine.save_pretrained: unexpected arguments {sorted(unknown)}")
        for key in sorted(kwargs):
            if kwargs[key] and key != "token":
                raise ValueError(
                    f"strata: engine.save_pretrained({key}=...) is not supported for a PEFT model: the "
                    f"engine writes its own gathered adapter weights into a local directory"
                )
        model = self.module
        adapters = list(model.peft_config) if selected_adapters is None else list(selected_adapters)
        missing = [a for a in adapters if a not in model.peft_config]
        if missing:
            raise ValueError(
                f"strata: engine.save_pretrained: no adapter {missing} in the model (its adapters: "
                f"{sorted(model.peft_config)})"
            )
        # PEFT picks and renames entries of a state dict; give it one of markers (one empty
        # tensor per state_dict entry) and map what it picks back to the model's tensors.
        entries = model.state_dict(keep_vars=True)
        markers = {name: torch.empty(0) for name in entries}
        of_marker = {id(m): entries[name] for name, m in markers.items()}
        by_id = {id(t): t for t in entries.values()}
        managed = {id(e.param) for g in self._groups for e in g.params}
        results = []
        for adapter in adapters:
            picked = get_peft_model_state_dict(
                model, state_dict=markers, adapter_name=adapter, save_embedding_layers=save_embedding_layers
            )
            saved = {}
            for name, m in picked.items():
                if id(m) not in of_marker:
                    raise ValueError(
                        f"strata: engine.save_pretrained: PEFT computes the saved {name} from the weights "
                        f"({model.peft_config[adapter].peft_type}); Strata saves adapters whose weights "
                        f"are parameters or buffers of the model"
                    )
                saved.setdefault(id(of_marker[id(m)]), name)  # a tensor once (safetensors: no aliases)
            params = [[(saved.get(id(e.param), ""), list(e.shape)) for e in g.params] for g in self._groups]
            whole, keep = _whole_entries(
                "save_pretrained", [(name, by_id[key]) for key, name in saved.items() if key not in managed]
            )
            out_dir = os.fspath(save_directory) if adapter == "default" else os.path.join(os.fspath(save_directory), adapter)
            files = [("adapter_config.json", _adapter_config_json(model, adapter))]
            results.append(self._core.save_model(out_dir, "adapter_model.safetensors", 1 << 62, params, whole, files, ""))
        return results[0] if len(results) == 1 else dict(zip(adapters, results))

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
        out, seen = [], set()
        for name, p in self.module.named_parameters():
            if id(p) in self._managed or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((_BLOB["unmanaged"] + name, p))
        for name, b in self.module.named_buffers():
            if b is not None:
                out.append((_BLOB["buffer"] + name, b))
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
        blobs.append((_BLOB["client_state"], "U8", [], buf.getvalue()))
        shapes = [[list(e.shape) for e in g.params] for g in self._groups]
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
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
        *,
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
        anyway.

        DeepSpeed's positional order (``load_module_strict`` third): the load is always
        strict (every name and shape must match), so ``load_module_strict=False`` and a
        ``custom_load_fn`` are refused rather than ignored."""
        if not load_module_strict:
            raise ValueError(
                "strata: engine.load_checkpoint(load_module_strict=False) is not supported: a Strata "
                "checkpoint loads only onto the model it was saved from (every name and shape checked)"
            )
        if custom_load_fn is not None:
            raise NotImplementedError("strata: engine.load_checkpoint(custom_load_fn=...) is not supported")
        load_dir = self._mp_dir(load_dir)
        if missing_ok and tag is None and not os.path.exists(os.path.join(load_dir, "latest")):
            # The same answer on every rank when load_dir is shared, as it must be.
            return None, None
        whole = self._whole_tensors()
        # At a step boundary; the engine's pass ends inside the load (engine/protocol). The
        # model's whole tensors are checked against the checkpoint's first.
        loaded = self._core.load_checkpoint(
            load_dir,
            tag or "",
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            bool(check_frozen_parameters),
            [(name, _SAFETENSORS_DTYPES.get(t.dtype, ""), list(t.shape)) for name, t in whole],
        )
        if not load_module_only:
            self._global_steps = int(loaded["global_steps"])  # steps_per_print counts on from there
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
        if _BLOB["client_state"] in blobs:
            try:
                client_state = torch.load(io.BytesIO(blobs[_BLOB["client_state"]][2]), weights_only=True)
            except Exception as exc:  # noqa: BLE001: the reason is passed on
                raise RuntimeError(
                    f"strata: engine.load_checkpoint: the client_state in {loaded['path']} cannot "
                    f"be read with torch.load(weights_only=True): {exc}"
                ) from exc
        self._needs_load = False
        return loaded["path"], client_state

    def close(self) -> None:
        """Writes the monitors' last events, removes the hooks and destroys the engine (the
        parameters stay empty)."""
        monitor, failed = getattr(self, "_monitor", None), None
        if monitor is not None:
            try:
                monitor.close()
            except RuntimeError as exc:  # raised once the engine is closed too
                failed = exc
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for g in self._groups:
            for e in g.params:
                e.param.data = torch.empty(0, dtype=self._compute, device=self.device)
                _strata.set_storage_data(e.cdata, 0, 0)
                if e.acc is not None:
                    e.acc.remove()
                e.acc = None
        self._core.close()
        if failed is not None:
            raise failed


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
    compiled = _hooks.compiled_modules(model)
    if compiled:
        raise ValueError(f"{_hooks.COMPILE_ERROR} Compiled here: {', '.join(compiled[:5])}")
    text = _setup.read_config(config)
    groups, group_of = None, None
    if model_parameters is None:
        params = [p for p in model.parameters() if p.requires_grad]
    else:
        model_parameters = list(model_parameters)
        if model_parameters and isinstance(model_parameters[0], dict):
            params, groups, group_of = _setup.param_groups(model_parameters)
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
    params, groups, group_of, meta_shapes = _setup.materialize_meta(model, params, groups, group_of)
    parts = _partitioned_parameters(model, params)
    meta_shapes.update({k: part.shape for k, (_, part) in parts.items()})
    engine = Engine(model, text, params, blocks, prefetch, timeout, groups, group_of, meta_shapes, mpu)
    pretrained = getattr(model, "_strata_pretrained", None)
    try:
        if parts:
            _assemble(engine, parts)
            engine._needs_load = any(k not in parts for k in meta_shapes)
        if pretrained is not None and meta_shapes:
            # from_pretrained under strata.zero.Init: the checkpoint's values, each rank
            # reading only its slices.
            engine.load_safetensors(pretrained)
            del model._strata_pretrained
    except BaseException:
        engine.close()  # the same on every rank: the failures above are agreed on
        raise
    return engine, engine.optimizer, None, engine.lr_scheduler


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
    AssembleParameters), one parameter at a time, in the engine's group order."""
    check = ""
    items, keep = [], []
    for g in engine._groups:
        for i, e in enumerate(g.params):
            entry = parts.get(id(e.param))
            if entry is None:
                continue
            part = entry[1]
            if (part.rank, part.world) != (engine.rank, engine.world_size) and not check:
                check = (
                    f"parameter {e.name} was partitioned by strata.zero.Init as rank {part.rank} of "
                    f"{part.world}, the engine is rank {engine.rank} of {engine.world_size}: build the model "
                    f"under the same ranks (pass the engine's mpu to strata.zero.Init)"
                )
            values = part.part.to(torch.float32).contiguous()
            keep.append(values)
            items.append((g.index, i, values.data_ptr() if values.numel() else 0, values.numel()))
    engine._core.assemble_parameters(items, check)
    for p, _ in parts.values():
        del p._strata_part


def load_safetensors(engine: Engine, path: Union[str, os.PathLike]) -> None:
    """``engine.load_safetensors(path)``: initial weights from safetensors files, each rank
    reading only its slices."""
    engine.load_safetensors(path)
