"""What the Python front end keeps beside the engine's hooks: its groups, and the checks
that keep the hooks out of torch.compile.

The hook protocol (engine/protocol/hook_protocol.h) and the LibTorch layer that binds the
parameter tensors, hooks their gradients and puts the autograd functions around a block
(engine/libtorch/tensor_engine.h) are the engine's, shared with the C++ front end; the
Python engine calls them from its module hooks (strata/engine.py).
"""

from __future__ import annotations

import math
import sys
from typing import List, Optional

import torch


class Group:
    """One of the engine's groups as this front end plans it (engine/protocol/groups.h): its
    parameters with their names, shapes (given for a parameter built without values under
    strata.zero.Init), optimizer groups and other names, and, for a block, the module."""

    def __init__(self, index: int, name: str, module: Optional[torch.nn.Module], frozen: bool, companion: int):
        self.index = index
        self.name = name
        self.module = module
        self.frozen = frozen
        self.companion = companion
        self.params: List[torch.nn.Parameter] = []
        self.names: List[str] = []
        self.shapes: List[Optional[tuple]] = []
        self.pgroups: List[int] = []
        self.aliases: List[List[str]] = []
        self.numels: List[int] = []  # as planned (the engine empties the tensors)

    def add(self, param, name: str, shape: Optional[tuple], pgroup: int, aliases: List[str]) -> None:
        self.params.append(param)
        self.names.append(name)
        self.shapes.append(None if shape is None else tuple(shape))
        self.pgroups.append(pgroup)
        self.aliases.append(aliases)
        self.numels.append(math.prod(shape) if shape is not None else param.numel())

    def numel(self) -> int:
        return sum(self.numels)

    def describe(self) -> tuple:
        """The group as _strata.Engine takes it."""
        params = [(n, p, None if s is None else list(s), pg, a)
                  for p, n, s, pg, a in zip(self.params, self.names, self.shapes, self.pgroups, self.aliases)]
        return (self.name, self.frozen, self.companion, params)


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
    checked on torch 2.11.0 (engine/libtorch/torch_internal.h lists every internal in use). Without Dynamo imported
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
