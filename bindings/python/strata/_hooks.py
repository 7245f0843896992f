"""What the Python front end keeps of the hook protocol: the torch side of it.

The protocol itself (which group is held, acquire and release order, gradient arrival,
closing the backward, recovering a voided iteration) lives once in the engine,
torch-free (engine/protocol/hook_protocol.h), and both front ends drive it; the Python
one through ``_strata.EngineCore``'s ``begin_forward``, ``pre_backward``, ``gradient``, ...
Here: the parameter tensors the protocol points and empties (``ParameterTensors``), the
autograd functions around a block's outputs and the inputs of a block with frozen
parameters, and the checks
that keep the hooks out of torch.compile (engine/libtorch/torch_internal.h lists the torch
internals in use).
"""

from __future__ import annotations

import math
import sys
from typing import List, Optional

import torch

from . import _strata


class Param:
    """A managed parameter: its tensor, name, shape, and the storage the engine points."""

    __slots__ = ("param", "name", "shape", "numel", "meta", "full", "empty", "cdata", "nbytes", "acc", "pgroup")

    def __init__(self, param: torch.nn.Parameter, name: str, shape: Optional[tuple] = None, pgroup: int = 0):
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
        self.pgroup = pgroup


class Group:
    """One of the engine's groups: its parameters and, for a block, the module."""

    def __init__(self, index: int, name: str, module: Optional[torch.nn.Module], params: List[Param],
                 frozen: bool, companion: int):
        self.index = index
        self.name = name
        self.module = module
        self.params = params
        self.frozen = frozen
        self.companion = companion


class ParameterTensors:
    """The parameter tensors as the hook protocol drives them (engine/protocol/
    hook_protocol.h's ParameterTensors): each managed parameter owns one storage whose data
    pointer is set to the gathered buffer (no copy) while its group is gathered, and to
    nothing otherwise; views autograd saved in the forward share that storage, so they see
    the re-gathered buffer in the backward."""

    def __init__(self, groups: List[Group]):
        self._groups = groups

    def point(self, group: int, addresses: List[int]) -> None:
        for e, a in zip(self._groups[group].params, addresses):
            _strata.set_storage_data(e.cdata, a, e.nbytes)
            e.param.data = e.full

    def empty(self, group: int) -> None:
        for e in self._groups[group].params:
            e.param.data = e.empty
            _strata.set_storage_data(e.cdata, 0, 0)

    def drop_gradients(self) -> None:
        for g in self._groups:
            for e in g.params:
                e.param.grad = None


def bind(e: Param, compute: torch.dtype, device: torch.device) -> None:
    """Gives a parameter its engine storage (its original memory is freed)."""
    full = torch.empty(e.shape, dtype=compute, device=device)
    storage = full.untyped_storage()
    e.full = full
    e.empty = torch.empty(0, dtype=compute, device=device).set_(storage, 0, (0,), (1,))
    e.cdata = storage_impl(storage)
    e.nbytes = e.numel * full.element_size()
    e.param.data = full
    e.param.grad = None


class _GroupIdentity(torch.autograd.Function):
    """Identity on tensors around a block; subclasses act in the backward."""

    @staticmethod
    def forward(ctx, core, group, *tensors):
        ctx.core = core
        ctx.group = group
        return tensors


class PreBackward(_GroupIdentity):
    """Identity on a block's outputs; its backward re-gathers the block (pre-backward)."""

    @staticmethod
    def backward(ctx, *grads):
        for g in grads:
            if g is not None:
                if g.is_cuda:  # this autograd thread's current stream is the compute stream
                    ctx.core.use_compute_stream(torch.cuda.current_stream(g.device).cuda_stream)
                break
        ctx.core.pre_backward(ctx.group)
        return (None, None) + grads


class PostBackward(_GroupIdentity):
    """Identity on the inputs of a block with frozen parameters; its backward runs once the
    block's backward produced the inputs' gradients, and tells the protocol so (no parameter
    gradient would tell when the frozen weights' last use is over)."""

    @staticmethod
    def backward(ctx, *grads):
        ctx.core.post_backward(ctx.group)
        return (None, None) + grads


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread: a forward hook
    that fires then is activation checkpointing's recompute."""
    return torch._C._current_graph_task_id() != -1


def eager(fn):
    """Strata's hooks never run inside a Dynamo graph: they call into the engine (gathers,
    data-pointer swaps), which Dynamo cannot trace. While Dynamo is not imported (nothing
    compiled yet) the hooks stay as they are: importing it loads Triton, about 110 MiB of
    resident memory per rank. A torch.compile later still meets the hooks' first check,
    under_torch_compile, which Dynamo cannot trace (sys._getframe: it warns so) and runs
    eagerly, and which then raises (tests/python/test_engine.py)."""
    if "torch._dynamo" not in sys.modules:
        return fn
    return torch.compiler.disable(fn, recursive=True)


COMPILE_ERROR = (
    "strata: a Strata-wrapped model does not work under torch.compile: Strata gathers and "
    "releases each block's parameters in forward hooks that Dynamo cannot trace, so Dynamo "
    "would fall back to running the model eagerly (nothing compiled). Call the engine "
    "without torch.compile (engine(x), not torch.compile(model)(x) or model.compile())."
)


def under_torch_compile() -> bool:
    """Whether a torch.compile'd callable is on the stack (Dynamo's OptimizedModule or its
    compile wrapper, in torch/_dynamo/eval_frame.py): Dynamo runs a hook it cannot trace
    eagerly and would otherwise swallow an error raised while tracing. Internal names,
    checked on torch 2.11.0 (engine/libtorch/torch_internal.h). Without Dynamo imported
    nothing is compiled; importing it here would load Triton into processes that never
    compile."""
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


def compiled_modules(model: torch.nn.Module) -> List[str]:
    return [
        name or "<model>"
        for name, m in model.named_modules()
        if getattr(m, "_compiled_call_impl", None) is not None or type(m).__name__ == "OptimizedModule"
    ]


def storage_impl(storage: torch.UntypedStorage) -> int:
    """The address of ``storage``'s c10::StorageImpl, which _strata.set_storage_data points
    at engine memory. ``UntypedStorage._cdata`` is internal: no public API exposes it
    (checked on torch 2.11.0; engine/libtorch/torch_internal.h lists every internal in use)."""
    return storage._cdata
