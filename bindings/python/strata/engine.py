"""The engine ``strata.initialize`` returns: DeepSpeed's engine API over the TensorEngine.

The TensorEngine (engine/libtorch/tensor_engine.h, ``_strata.Engine`` here) is the one
LibTorch layer under both front ends: it chooses the compute device, reads the initial
values, binds each parameter tensor to the engine (pointed at the gathered buffer while its
group is held, empty otherwise), hooks the gradients, runs the autograd functions around
the blocks and writes and reads checkpoints and safetensors. What stays here is Python's:

- groups (engine/protocol/groups.h): group 0 ("root") holds every managed parameter outside
  the blocks; groups 1.. are the blocks (``strata._setup.default_blocks``, or ``blocks=``).
  A parameter shared by two blocks, or by a block and a module outside it, goes to the
  root group. Frozen parameters (requires_grad False) form a frozen group beside their
  block's;
- forward pre/post hooks on each block call the engine's ``begin_forward`` and
  ``end_forward`` and put its autograd functions around the block's inputs and outputs;
- the training API (DeepSpeed's calling convention), the torch.compile guard, profiler
  ranges, monitors, and (strata._checkpoints, strata._model_io) Python's RNG and pickles in
  checkpoints and the Hugging Face layout.

strata.zero talks to an engine through three calls only: ``_gather_whole(params)`` (the
parameters whole, in the working dtype: returns what this call gathered), and
``_release_whole(held, modifier_rank)`` (given back, the modifier's changes written into
every rank's master and shards), and ``_find(param)`` ((group, index) or None).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.utils import _pytree

from . import _hooks, _setup, _strata
from ._checkpoints import CheckpointMixin
from ._deepspeed_api import DeepSpeedApiMixin
from ._model_io import ModelIOMixin
from ._optimizer import EngineOptimizer, EngineScheduler

__all__ = ["Engine"]


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
    """A named range in torch.profiler's trace while the profiler runs on this thread."""
    if torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def _copies_of_own_parameters(output, own: set):
    """A block's output with the block's own parameters in it (DeepSpeed's test: a module
    returning its bias for the parent to add) replaced by copies made while they are whole:
    the block's group is released when its forward ends, the copy stays, and its gradient
    reaches the parameter through autograd (DeepSpeed registers such a parameter as external
    and keeps it gathered; the copy costs the same memory)."""
    leaves, spec = _pytree.tree_flatten(output)
    hits = [k for k, t in enumerate(leaves) if isinstance(t, torch.nn.Parameter) and id(t) in own]
    if not hits:
        return output
    for k in hits:
        leaves[k] = leaves[k].clone()
    return _pytree.tree_unflatten(leaves, spec)


def _requiring_grad(tree) -> tuple:
    """(leaves, spec, positions of the tensors that require grad) of a pytree."""
    leaves, spec = _pytree.tree_flatten(tree)
    pos = [k for k, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    return leaves, spec, pos


class Engine(CheckpointMixin, ModelIOMixin, DeepSpeedApiMixin):
    """The object ``strata.initialize`` returns (DeepSpeed's engine calling convention).

    ``engine(*args, **kwargs)`` runs the model (under ``torch.no_grad()`` it is an
    evaluation forward), ``engine.backward(loss)``, ``engine.step()`` after every
    backward, ``engine.get_lr()``, ``engine.statistics()``, ``engine.gather_parameters()``.
    """

    def __init__(self, model: torch.nn.Module, config_text: str, params: List[torch.nn.Parameter],
                 blocks: Optional[Sequence[torch.nn.Module]], prefetch: bool, timeout_s: float,
                 param_groups: Optional[List[dict]] = None, group_of: Optional[Dict[int, int]] = None,
                 meta_shapes: Optional[Dict[int, tuple]] = None, mpu: Any = None, counter: int = 0):
        self.module = model
        self._self_ref = weakref.ref(self)
        self._handles: List[Any] = []
        self._ranges: List[Any] = []  # torch.profiler ranges of the blocks whose forward runs
        self._inside: List[int] = []  # the groups whose module's forward runs, outermost first
        self._closed = False
        # Built under strata.zero.Init without values: none until strata.load_safetensors.
        self._needs_load = bool(meta_shapes)
        cfg = _setup.config_dict(config_text)
        self._groups, self._managed = _setup.plan_groups(model, params, blocks, meta_shapes or {}, group_of)
        rv, self._global_rank, self._mp_rank, self._mp_world, ranks = _setup.rendezvous(mpu, config_text, counter)
        from . import checkpointing

        checkpointing._from_engine_config(cfg)  # strata.checkpointing follows this engine's config
        # The monitors first: a failure to open one (rank 0's alone) is agreed on by every rank
        # before the engine takes anything, and leaves every rank's model as it was.
        self._monitor, failed = None, None
        try:
            self._monitor = _setup.monitor(config_text, ranks, self._global_rank, sum(g.numel() for g in self._groups))
        except Exception as exc:  # noqa: BLE001: raised below, on every rank
            failed = exc
        follow = [t for _, t, _, _ in self._whole_tensors()]
        try:
            self._core = _strata.Engine(config_text, [g.describe() for g in self._groups], follow, rv, prefetch,
                                        timeout_s, [_setup.core_group_options(g) for g in (param_groups or [])],
                                        f"{type(failed).__name__}: {failed}" if failed is not None else "")
        except BaseException:
            if self._monitor is not None:
                self._monitor.close()
            if failed is not None:
                raise failed from None  # this rank's own error, as it was
            raise
        try:
            self.device = self._core.device
            self._compute = self._core.compute_dtype
            for g in self._groups:
                for p in g.params:
                    p._strata_engine = self._self_ref  # how strata.zero finds a parameter's engine
                if g.module is not None:
                    self._handles.append(
                        g.module.register_forward_pre_hook(self._pre_hook(g.index), with_kwargs=True))
                    self._handles.append(g.module.register_forward_hook(self._post_hook(g.index)))
            self.optimizer = EngineOptimizer(self, param_groups or [{"params": params}], _setup.config_lr(cfg))
            self.lr_scheduler = EngineScheduler(self) if cfg.get("scheduler") else None
        except BaseException:
            self.close(restore=True)  # the same on every rank: nothing above depends on the rank
            raise
        # steps_per_print (DeepSpeed's): rank 0 logs a progress line every so many optimizer
        # steps through the "strata" logger; 0 or less: never.
        self._steps_per_print = int(cfg.get("steps_per_print", 10))
        self._betas = tuple((cfg.get("optimizer") or {}).get("params", {}).get("betas", (0.9, 0.999)))
        self._global_steps = 0
        self._last_step: Optional[dict] = None  # the last step()'s outcome
        self._client_schedule = None  # a client lr_scheduler's (strata/_client.py), set by initialize
        # wall_clock_breakdown (DeepSpeed's): {phase: [seconds, count]} since the last line.
        self._phase_times = {"fwd": [0.0, 0], "bwd": [0.0, 0], "step": [0.0, 0]} \
            if cfg.get("wall_clock_breakdown") else None

    # ------------------------------------------------------------------ hooks

    def _pre_hook(self, index: int):
        name = f"strata::forward {self._groups[index].name}"

        def hook(module, args, kwargs):
            if _hooks.under_torch_compile():
                raise RuntimeError(_hooks.COMPILE_ERROR)
            # In a backward: activation checkpointing's recompute, gathered as for its
            # backward (the engine recognizes it); no profiler range of its own.
            if not _hooks.in_backward() and torch.autograd._profiler_enabled():
                r = torch.autograd.profiler.record_function(name)
                r.__enter__()
                self._ranges.append(r)
            self._core.begin_forward(index)
            self._inside.append(index)
            g = self._groups[index]
            if not torch.is_grad_enabled() or (g.companion < 0 and not g.frozen):
                return None  # no frozen parameter: nothing to wrap
            leaves, spec, pos = _requiring_grad((args, kwargs))
            if not pos:
                return None
            wrapped = self._core.wrap_inputs(index, [leaves[k] for k in pos])
            if all(w is leaves[k] for k, w in zip(pos, wrapped)):
                return None
            for k, t in zip(pos, wrapped):
                leaves[k] = t
            return _pytree.tree_unflatten(leaves, spec)

        return _hooks.eager(hook)

    def _post_hook(self, index: int):
        name = f"strata::forward {self._groups[index].name}"

        own = {id(p) for p in self._groups[index].params}

        def hook(module, inputs, output):
            if _hooks.in_backward():
                return output  # a recompute: released with the backward
            output = _copies_of_own_parameters(output, own)
            try:
                self._core.end_forward(index)
            finally:
                self._close_range(name)
                if self._inside and self._inside[-1] == index:
                    self._inside.pop()
            if not torch.is_grad_enabled():
                return output
            leaves, spec, pos = _requiring_grad(output)
            if not pos:
                return output
            for k, t in zip(pos, self._core.wrap_outputs(index, [leaves[k] for k in pos])):
                leaves[k] = t
            return _pytree.tree_unflatten(leaves, spec)

        return _hooks.eager(hook)

    def _close_range(self, name: str) -> None:
        """Closes the innermost open block range of that name (the profiler may have
        stopped since it opened: the range is closed all the same)."""
        for k in range(len(self._ranges) - 1, -1, -1):
            if self._ranges[k].name == name:
                self._ranges.pop(k).__exit__(None, None, None)
                return

    def _empty_here(self) -> List[str]:
        """Where a forward raised: the parameters of the groups inside the innermost running
        block (the model when none runs) that are not gathered there, by name: what an
        operation there sees empty when the block's forward uses them directly."""
        inner = self._groups[self._inside[-1]].module if self._inside else self.module
        running = set(self._inside)
        inside = {id(m) for m in inner.modules()}
        out = []
        for g in self._groups:
            if g.index in running or g.module is None or id(g.module) not in inside:
                continue
            out += [n for p, n in zip(g.params, g.names) if p.numel() == 0]
        return out

    def _abort_forward(self) -> None:
        """A forward raised: forward hooks do not run after an exception; the engine closes
        the blocks it left gathered (an error of its own is kept and reported by the next
        call: the forward's exception propagates)."""
        while self._ranges:
            self._ranges.pop().__exit__(None, None, None)
        self._inside.clear()
        try:
            self._core.abort_forward()
        except Exception:  # noqa: BLE001: kept by the engine, raised by the next call
            pass

    # ------------------------------------------------------------------ training

    def __getattr__(self, name: str):
        """What the engine does not have falls through to the model (DeepSpeed's engine does
        the same): ``engine.config`` of a transformers model, say. One neither has is said
        naming the engine (and, for DeepSpeed engine's own that Strata lacks, why)."""
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        try:
            return getattr(module, name)
        except AttributeError:
            raise self._missing(name) from None

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        """Runs the model. Under torch.no_grad() this is an evaluation forward (the engine
        prefetches only what it uses and releases everything after it)."""
        self._core.check_forward()
        if self._core.holds_whole:
            raise RuntimeError(
                "strata: a forward inside strata.zero.GatheredParameters: leave the context first "
                "(the engine gathers what a forward uses by itself)"
            )
        if self._needs_load:
            raise RuntimeError(
                "strata: the model was built under strata.zero.Init: its parameters have no values "
                "yet; load them first with strata.load_safetensors(engine, path)"
            )
        training = torch.is_grad_enabled()
        if training:
            self._monitor.record_forward(args, kwargs)
        else:
            self._core.begin_eval()
        with _profiler_range("strata::forward" if training else "strata::forward (no backward)"), \
                self._timed("fwd" if training else None):
            try:
                return self.module(*args, **kwargs)
            except BaseException as exc:
                empty = self._empty_here() if isinstance(exc, RuntimeError) else []
                self._abort_forward()
                if empty:
                    exc.add_note(
                        f"strata: here these parameters are empty (each is whole only inside its own module's "
                        f"forward): {', '.join(empty[:4])}{' ...' if len(empty) > 4 else ''}. If this forward uses "
                        f"one directly (F.linear(x, self.linear1.weight)), register it before strata.initialize: "
                        f"strata.zero.register_external_parameter(self, self.linear1.weight)")
                raise
            finally:
                if not training:
                    self._core.end_eval()

    def backward(self, loss: torch.Tensor) -> None:
        """Scales the loss (loss scale / gradient_accumulation_steps), runs autograd and
        hands every gradient to the engine (reduce-scatter into the optimizer's shards)."""
        scaled = self._core.begin_backward(loss if isinstance(loss, torch.Tensor) else torch.empty(0))
        self._monitor.record_loss(loss)
        with _profiler_range("strata::backward"), self._timed("bwd"):
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
        schedule = self._client_schedule
        if schedule is not None:
            self._core.set_lr(schedule.base_lr())  # the client scheduler's rate, as it set it
        with _profiler_range("strata::step"), self._timed("step"):
            out = self._core.step()
        self._last_step = out
        if schedule is not None and out["boundary"] and out["applied"]:
            schedule.after_applied_step()  # as DeepSpeed's: not after a skipped (overflow) step
            self._core.set_lr(schedule.base_lr())  # get_lr() says the next step's rate
        if out["boundary"]:
            self._global_steps += 1
            every = self._steps_per_print
            if every > 0 and self._global_steps % every == 0 and self._core.rank == 0:
                _logger().info("[Rank 0] step=%d, skipped=%d, lr=%s, mom=%s", self._global_steps,
                               self._core.skipped_steps(), [out["lr"]], [self._betas])
            if every > 0 and self._global_steps % every == 0 and self._phase_times is not None:
                self._log_phase_times()
            self._monitor.record_step(self._global_steps, out, self._core.stats)
        return out

    @contextlib.contextmanager
    def _timed(self, phase: Optional[str]):
        """wall_clock_breakdown: the wall-clock time of the block, the device synchronized
        first and last (its queued work counts where it was issued, as DeepSpeed's timers)."""
        if self._phase_times is None or phase is None:
            yield
            return
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            sync()
            slot = self._phase_times[phase]
            slot[0] += time.perf_counter() - start
            slot[1] += 1

    def _log_phase_times(self) -> None:
        """DeepSpeed's wall_clock_breakdown line: each phase's mean per micro-step, ms."""
        if self._core.rank == 0:
            means = {k: 1e3 * t / n if n else 0.0 for k, (t, n) in self._phase_times.items()}
            _logger().info("[Rank 0] time (ms) | fwd_microstep: %.2f | bwd_microstep: %.2f | step_microstep: %.2f",
                           means["fwd"], means["bwd"], means["step"])
        self._phase_times = {k: [0.0, 0] for k in self._phase_times}

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
        self._core.write_chrome_trace(str(path), self.timeline() if events is None else events)

    def groups(self) -> List[dict]:
        """Each group's name, sizes and parameters (name, numel, offset) as the engine laid them out."""
        return [self._core.layout(g.index) for g in self._groups]

    def group_of(self, param: torch.nn.Parameter) -> int:
        found = self._core.find(param)
        if found is None:
            raise ValueError("strata: not a parameter managed by this engine")
        return found[0]

    def full_buffer_addresses(self, group: int) -> List[int]:
        """The addresses of a gathered group's parameters in the engine's buffer."""
        return self._core.full_buffer(group)

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

    # ------------------------------------------------------------------ strata.zero's interface

    def _find(self, param) -> Optional[tuple]:
        return None if self._closed else self._core.find(param)

    def _gather_whole(self, params: List[torch.Tensor]) -> List[tuple]:
        return self._core.gather_whole(params)

    def _release_whole(self, held: List[tuple], modifier_rank: Optional[int]) -> None:
        self._core.release_whole(held, modifier_rank)

    def _whole_tensors(self) -> List[tuple]:
        """What this front end keeps whole, as the engine takes it: (name, tensor, is a
        parameter, other names): the parameters it does not manage (requiring grad but left
        out of model_parameters; the same on every rank: rank 0's is saved) and the buffers
        (each rank's own). Frozen parameters are in the engine's frozen groups."""
        names = collections.defaultdict(list)
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names[id(p)].append(name)
        out, seen = [], set()
        for name, p in self.module.named_parameters():
            if id(p) in self._managed or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((name, p, True, [n for n in names[id(p)] if n != name]))
        for name, b in self.module.named_buffers():
            if b is not None:
                out.append((name, b, False, []))
        return out

    def close(self, restore: bool = False, keep_empty: Optional[set] = None) -> None:
        """Writes the monitors' last events, removes the hooks and destroys the engine. The
        parameters stay empty, unless ``restore`` (a collective: every rank passes it): each
        gets its value back (the fp32 master in the parameter's dtype) and the model is as
        it was before ``strata.initialize``, ready for another engine (but those with an id
        in ``keep_empty``: built without values)."""
        monitor, failed = getattr(self, "_monitor", None), None
        if monitor is not None:
            try:
                monitor.close()
            except RuntimeError as exc:  # raised once the engine is closed too
                failed = exc
        for h in self._handles:
            h.remove()
        self._handles.clear()
        values = self._values_to_give_back(keep_empty or set()) if restore and not self._closed else []
        self._closed = True
        self._core.close()  # empties the parameters it held
        with torch.no_grad():
            for p, v in values:
                p.data = v.to(p.dtype)
        for g in self._groups:
            for p in g.params:
                if getattr(p, "_strata_engine", None) is self._self_ref and restore:
                    del p._strata_engine
        if failed is not None:
            raise failed

    def _values_to_give_back(self, keep_empty: set) -> List[tuple]:
        """Collective: [(parameter, its value gathered from the engine)] for every managed
        parameter but those strata.zero.Init partitioned (they keep their parts) or built
        without values (``keep_empty``)."""
        from .zero import partitioned

        params = [p for g in self._groups for p in g.params
                  if id(p) not in keep_empty and partitioned(p) is None]
        return list(zip(params, self._core.gather_parameters(params))) if params else []
