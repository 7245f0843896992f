"""``strata.zero.Init``: build a model without any rank holding it whole,
and ``strata.zero.GatheredParameters``: a partitioned parameter whole for a while.

    with strata.zero.Init(ds_config):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    engine, *_ = strata.initialize(model=model, config=ds_config)   # trains from those values

As DeepSpeed's ``zero.Init``: each parameter keeps the value its construction gave it, but
only this rank's part of it: once a module is built (when it is attached to its parent, or
when the context closes for the top-level module) each of its parameters is cut to
``comm::Partition(numel, W, rank)`` of its elements and its memory freed, so building holds
about one module whole plus this rank's parts. ``strata.initialize`` then assembles the
engine's shards from every rank's parts, one parameter at a time (the same values as the
same model built without the context with the same seed, on every world size).
Initializations that run after a module is built still apply: ``module.apply(fn)`` and a
transformers model's ``post_init()`` (``_initialize_weights`` per module) see each module's
own parameters at their full shape while ``fn`` runs, this rank's part filled in and zeros
elsewhere; what they write into this rank's part is kept. So fills, random draws and
elementwise changes give plain construction's values; an initialization that reads other
elements of a parameter than those it writes (a normalization by the tensor's norm) would
see the zeros: do such a thing under ``GatheredParameters`` after ``strata.initialize``.

``Init(meta=True)``: every parameter is built on the meta device instead (no values at all,
not even a part), for a model whose weights are loaded anyway:
``strata.load_safetensors(engine, path)`` after ``strata.initialize`` (a forward before it
raises). ``from_pretrained(dir)`` under either mode builds the model that way and
``strata.initialize`` loads the directory's safetensors, each rank reading only its slices.
Buffers stay real in both modes (rotary tables and masks computed in ``__init__``).

Rank and world size: ``mpu``'s data-parallel group when given, else torch.distributed's
when initialized, else torchrun's RANK and WORLD_SIZE, else one process; they must be the
engine's (``strata.initialize`` checks).
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import weakref
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook

from . import _part_file, _part_gather, _pretrained

__all__ = ["Init", "GatheredParameters", "register_external_parameter", "unregister_external_parameter"]

_active: Optional["Init"] = None
# The heap is trimmed once partitioning has freed this much since the last trim (and when
# the context closes): a trim per module would cost more than it gives for small modules.
_TRIM_AFTER = 4 << 20


class _Part:
    """What strata.zero.Init keeps of a parameter: its shape and this rank's part of it."""

    __slots__ = ("shape", "numel", "offset", "part", "rank", "world", "open", "group")

    def __init__(self, shape, numel, offset, part, rank, world, group=None):
        self.shape = shape
        self.numel = numel
        self.offset = offset
        self.part = part
        self.rank = rank
        self.world = world
        self.open = 0  # materializations in progress
        self.group = group  # the torch.distributed group of the ranks (None: the default one)


def _cut(flat: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """This rank's part of ``flat``: a copy when it is a slice (the rest is then freed), the
    tensor itself when it is the whole (one rank: no second copy of the parameter)."""
    if offset == 0 and count == flat.numel():
        return flat
    return flat[offset : offset + count].clone()


def _store(part: _Part, flat: torch.Tensor) -> None:
    """This rank's elements of ``flat`` (the whole parameter, after a materialization wrote
    it) become the part again: copied into the part in place (no second part beside it while
    it is copied), its file's pages written back and dropped where it is on the disk; a part
    whose dtype the initialization changed is kept anew."""
    count = part.part.numel()
    values = flat[part.offset : part.offset + count]
    store = _part_file.file_of(part.part)
    if values.dtype != part.part.dtype or values.device != part.part.device:
        part.part = store.keep(values) if store is not None else _cut(flat, part.offset, count)
        return
    if values.data_ptr() != part.part.data_ptr():
        part.part.copy_(values)
    if store is not None:
        store.settle(part.part)


def _share(numel: int, world: int, rank: int) -> tuple:
    """comm::Partition: the first numel % world ranks hold one element more."""
    base, extra = divmod(numel, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def _to_meta(module: torch.nn.Module, name: str, param):
    if param is None or param.is_meta:
        return None
    return torch.nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)


def partitioned(param) -> Optional[_Part]:
    """The part strata.zero.Init kept of ``param`` (None: not partitioned)."""
    return getattr(param, "_strata_part", None)


_internal = 0  # > 0 while this module itself changes partitioned parameters


@contextlib.contextmanager
def _inside():
    global _internal
    _internal += 1
    try:
        yield
    finally:
        _internal -= 1


# What a partitioned parameter answers about itself as the whole parameter would.
_METADATA = {"size", "dim", "ndimension", "numel", "nelement"}
# Questions whose answer does not depend on the values or the shape.
_HARMLESS = {"__get__", "__set__", "data_ptr", "element_size", "is_floating_point", "is_complex", "is_contiguous",
             "__repr__", "__format__", "__hash__", "requires_grad_", "_is_view", "is_shared", "untyped_storage",
             "storage", "_typed_storage", "get_device"}
_HARMLESS_ATTRIBUTES = {"dtype", "device", "requires_grad", "is_meta", "is_cuda", "is_cpu", "layout", "grad",
                        "grad_fn", "is_leaf", "is_sparse", "is_quantized", "is_nested", "names", "name", "_base",
                        "output_nr", "_version", "__dict__", "__class__"}


def _targets(args, kwargs) -> list:
    from torch.utils import _pytree

    out = {}
    for a in _pytree.tree_leaves((args, kwargs)):
        if isinstance(a, torch.nn.Parameter):
            part = partitioned(a)
            if part is not None and part.open == 0:
                out.setdefault(id(a), a)
    return list(out.values())


class _PartitionGuard(torch.overrides.TorchFunctionMode):
    """While strata.zero.Init is open: a parameter partitioned already (its module built)
    answers its shape as the whole parameter; an in-place change (torch.nn.init.*,
    normal_, fill_, mul_, copy_, ...) runs on it at its full shape (this rank's part kept,
    as in _materialized); anything else that would read its values raises (the values are
    not all here)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _internal:
            return func(*args, **kwargs)
        targets = _targets(args, kwargs)
        if not targets:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        # The tensor the function is about: its first argument, positional or (torch.nn.init's
        # functions) by keyword.
        first = args[0] if args else next((kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)
        if name == "__get__":
            attr = getattr(getattr(func, "__self__", None), "__name__", "")
            if attr == "shape" and first is not None and partitioned(first) is not None:
                return torch.Size(partitioned(first).shape)
            if attr in _HARMLESS_ATTRIBUTES or first is None or partitioned(first) is None:
                return func(*args, **kwargs)
            raise _read_error(first, f".{attr}")
        if name in _METADATA and first is not None and partitioned(first) is not None:
            return getattr(torch.empty(partitioned(first).shape, device="meta"), name)(*args[1:], **kwargs)
        if name in _HARMLESS:
            return func(*args, **kwargs)
        if name.endswith("_") and not name.startswith("__") and first is not None and partitioned(first) is not None:
            with contextlib.ExitStack() as stack:
                for t in targets:
                    stack.enter_context(_materialized_params([t]))
                return func(*args, **kwargs)
        raise _read_error(targets[0], f"{name}()")


def _read_error(param, what: str) -> RuntimeError:
    part = partitioned(param)
    return RuntimeError(
        f"strata.zero.Init: {what} of a parameter of shape {tuple(part.shape)} whose module is built: under "
        f"strata.zero.Init a module's own parameters keep only this rank's part once its constructor returns, "
        f"so their values cannot be read. Change them in place (torch.nn.init.*, fill_, mul_, copy_), in the "
        f"module's constructor or in module.apply(fn); read them under strata.zero.GatheredParameters after "
        f"strata.initialize; or build with strata.zero.Init(meta=True) and load the weights"
    )


@contextlib.contextmanager
def _materialized(module: torch.nn.Module):
    """The module's own partitioned parameters at their full shape (this rank's part, zeros
    elsewhere) while the block runs; what it leaves in this rank's part is kept."""
    with _materialized_params([p for p in module._parameters.values() if p is not None]):
        yield


@contextlib.contextmanager
def _materialized_params(params):
    """Those of ``params`` that are partitioned, at their full shape (this rank's part,
    zeros elsewhere) while the block runs; what it leaves in this rank's part is kept."""
    opened = []
    with torch.no_grad(), _inside():
        for p in params:
            part = partitioned(p)
            if part is None:
                continue
            if part.open == 0:
                if part.part.numel() == part.numel:
                    full = part.part  # one rank: the part is the whole, no second copy
                else:
                    full = torch.zeros(part.numel, dtype=p.dtype, device=p.device)
                    full[part.offset : part.offset + part.part.numel()] = part.part
                p.data = full.view(part.shape)
            part.open += 1
            opened.append((p, part))
    try:
        yield
    finally:
        freed = 0
        with torch.no_grad(), _inside():
            for p, part in opened:
                part.open -= 1
                if part.open == 0:
                    flat = p.data.reshape(-1)
                    if flat.numel() != part.numel:
                        raise RuntimeError(
                            f"strata.zero.Init: a parameter changed shape during its initialization "
                            f"({tuple(part.shape)} -> {tuple(p.data.shape)})"
                        )
                    _store(part, flat)
                    if flat.data_ptr() != part.part.data_ptr() and flat.device.type == "cpu":
                        freed += flat.numel() * flat.element_size()
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        if _active is not None and freed:
            _active._freed += freed  # the whole parameters made for the while: trimmed as built ones
            if _active._freed >= _TRIM_AFTER:
                _active._trim()


class Init:
    """Context manager: builds a model partitioned (the module docstring).

    ``config`` (a dict, JSON string or path, DeepSpeed's ``config_dict_or_path`` too) is
    validated when given; its ``offload_param`` says where the parts are kept, as
    DeepSpeed's: on ``nvme``, in a file under its ``nvme_path`` (unlinked: nothing is left
    behind), out of memory until ``strata.initialize`` reads them; else in host memory.
    ``remote_device`` ("cpu", "nvme" or "none"; DeepSpeed's) says the same without a config
    and must agree with the config's when both are given. ``pin_memory`` and
    ``mem_efficient_linear`` are accepted and change nothing: the parts are read once, by
    ``strata.initialize``, which pins its own buffers, and Strata's hooks gather what a
    module's forward uses without replacing torch's linear. ``meta=True``: no values at all
    (weights loaded afterwards). ``mpu``: the model-parallel unit whose data-parallel group
    partitions (as ``strata.initialize``'s), or ``data_parallel_group`` (DeepSpeed's: a
    torch.distributed group). ``enabled=False`` makes the context do nothing (DeepSpeed's
    switch); an Init inside another does nothing either (the outer one partitions, as
    DeepSpeed's). ``module`` (DeepSpeed's, also as the first positional argument): a module
    built outside the context, partitioned at once. ``dtype``: the floating-point parts are
    kept in it (None: the dtype the model is built in; DeepSpeed's default is the config's
    fp16/bf16, Strata's working copy follows the config either way). DeepSpeed's other
    keywords (``zero_param_parallel_group``, ``zero_quantized_weights``, ...) are accepted at
    their defaults and refused, with the reason, otherwise (docs/deepspeed.md). Under
    torch.distributed (initialized, several ranks) every parameter is broadcast from the
    group's first rank as it is partitioned, so all ranks keep rank 0's values, as
    DeepSpeed's; without it each rank keeps the values it built (seed them the same)."""

    def __init__(
        self,
        config: Union[Mapping[str, Any], str, torch.nn.Module, None] = None,
        *,
        module: Optional[torch.nn.Module] = None,
        data_parallel_group: Any = None,
        config_dict_or_path: Union[Mapping[str, Any], str, None] = None,
        enabled: bool = True,
        dtype: Optional[torch.dtype] = None,
        meta: bool = False,
        mpu: Any = None,
        remote_device: Optional[str] = None,
        pin_memory: bool = False,
        mem_efficient_linear: bool = True,
        **deepspeed_keywords: Any,
    ):
        from . import validate_config

        if isinstance(config, torch.nn.Module):  # DeepSpeed's first positional argument
            module, config = config, None
        _check_deepspeed_keywords(deepspeed_keywords)
        config = config if config is not None else config_dict_or_path
        if config is None:
            config = deepspeed_keywords.get("config")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"strata.zero.Init: dtype must be a floating-point torch.dtype, got {dtype!r}")
        self._mpu = mpu
        self._group = data_parallel_group
        self._parts_group = None  # the torch.distributed group the parts span (None: the default one)
        # The batch sizes checked for the world the parts are cut for.
        normalized = validate_config(config, world_size=self._rank_and_world()[1]) if config is not None else None
        self._parts_dir = _parts_directory(normalized, remote_device)
        self._part_file: Optional[_part_file.PartFile] = None
        self.pin_memory, self.mem_efficient_linear = bool(pin_memory), bool(mem_efficient_linear)
        self.enabled = enabled
        self.dtype = dtype
        self.meta = bool(meta)
        self._broadcast = False  # rank 0's values to every rank as each parameter is partitioned
        self._nested = False
        self._handles: List[Any] = []
        self._patched: List[tuple] = []
        self._pending: "weakref.WeakValueDictionary[int, torch.nn.Parameter]" = weakref.WeakValueDictionary()
        self.rank, self.world_size = 0, 1
        self._freed = 0  # host bytes partitioning freed since the heap was last trimmed
        if module is not None and enabled:
            self._partition_built(module)

    def _partition_built(self, module: torch.nn.Module) -> None:
        """DeepSpeed's ``Init(module=m)``: a module built outside the context is partitioned
        at once, as if built inside it."""
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"strata.zero.Init: module must be a torch.nn.Module, got {type(module).__name__}")
        if self.meta:
            raise ValueError("strata.zero.Init: module= with meta=True: the module's values would be dropped")
        self._set_ranks()
        for p in module.parameters():
            self._partition(p)
        self._trim()

    def _set_ranks(self) -> None:
        """The ranks that partition, their torch.distributed group and whether rank 0's
        values are broadcast (strata/_part_gather.py)."""
        self.rank, self.world_size = self._rank_and_world()
        self._broadcast = _part_gather.usable(self.world_size)
        self._parts_group = self._group
        if self._parts_group is None and self._mpu is not None and self._broadcast:
            from ._setup import mpu_call

            self._parts_group = mpu_call(self._mpu, "get_data_parallel_group")

    def _rank_and_world(self) -> tuple:
        if self._group is not None:
            if self._mpu is not None:
                raise ValueError("strata.zero.Init: pass data_parallel_group or mpu, not both")
            return torch.distributed.get_rank(self._group), torch.distributed.get_world_size(self._group)
        if self._mpu is not None:
            from ._setup import mpu_call

            return int(mpu_call(self._mpu, "get_data_parallel_rank")), int(
                mpu_call(self._mpu, "get_data_parallel_world_size")
            )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        if "WORLD_SIZE" in os.environ:
            return int(os.environ.get("RANK", "0")), int(os.environ["WORLD_SIZE"])
        return 0, 1

    def __enter__(self) -> "Init":
        global _active
        if not self.enabled:
            return self
        if _active is not None:
            # DeepSpeed's rule: an Init inside another changes nothing (the outer one partitions).
            self._nested = True
            return self
        self._set_ranks()
        _active = self
        self._handles = [register_module_parameter_registration_hook(self._on_parameter)]
        self._patched = _patch_from_pretrained() + _patch_initializers()
        if not self.meta:
            _patch_constructors(self)  # appends to self._patched, also while the context is open
            self._guard = _PartitionGuard()
            self._guard.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if _active is not self:
            return
        try:
            if not self.meta:
                # The top-level module's own parameters, and those of modules never attached.
                for p in list(self._pending.values()):
                    self._partition(p)
                self._trim()
        finally:
            if getattr(self, "_guard", None) is not None:
                self._guard.__exit__(None, None, None)
                self._guard = None
            for h in self._handles:
                h.remove()
            self._handles = []
            for owner, name, original in reversed(self._patched):
                if original is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            self._patched = []
            self._pending = weakref.WeakValueDictionary()
            _active = None

    # ------------------------------------------------------------------ hooks

    def _on_parameter(self, module, name, param):
        if self.meta:
            return _to_meta(module, name, param)
        if param is not None and not param.is_meta and partitioned(param) is None:
            self._pending[id(param)] = param  # its values come later in __init__
        return None

    def _built(self, module: torch.nn.Module) -> None:
        """``module``'s constructor returned: its own parameters are partitioned (its
        children's were, at the end of theirs)."""
        if self.meta:
            return
        for p in module._parameters.values():
            if p is not None and id(p) in self._pending:
                self._partition(p)
        if self._freed >= _TRIM_AFTER:
            self._trim()

    def _trim(self) -> None:
        """The memory the partitioned parameters left goes back to the system: glibc keeps
        freed chunks of its heap resident, and once a large tensor was freed its dynamic mmap
        threshold serves the next ones from the heap too, so without this building grows the
        resident set by the whole model, not this rank's part (measured)."""
        from . import _strata

        _strata.trim_heap()
        self._freed = 0

    def _partition(self, p: torch.nn.Parameter) -> None:
        self._pending.pop(id(p), None)
        if partitioned(p) is not None or p.is_meta:
            return
        with torch.no_grad(), _inside():
            flat = p.detach().reshape(-1)
            if self._broadcast:
                _part_gather.broadcast_from(flat, self._parts_group)  # rank 0's values, as DeepSpeed's
            offset, count = _share(flat.numel(), self.world_size, self.rank)
            dtype = self.dtype if self.dtype is not None and p.is_floating_point() else p.dtype
            if self._parts_dir is not None and p.device.type == "cpu":
                if self._part_file is None:
                    self._part_file = _part_file.PartFile(self._parts_dir)
                kept, kept_bytes = self._part_file.keep(flat[offset : offset + count].to(dtype)), 0
            else:
                kept = _cut(flat, offset, count) if dtype == p.dtype else flat[offset : offset + count].to(dtype)
                kept_bytes = kept.numel() * kept.element_size()  # the whole itself on one rank
            p._strata_part = _Part(tuple(p.shape), flat.numel(), offset, kept, self.rank, self.world_size,
                                   self._parts_group)
            if p.device.type == "cpu":
                self._freed += max(0, flat.numel() * p.element_size() - kept_bytes)
            p.data = torch.empty(0, dtype=dtype, device=p.device)

    @property
    def parts_on_disk(self) -> int:
        """Bytes of this rank's parts kept in the nvme_path file (0: in memory)."""
        return self._part_file.bytes if self._part_file is not None else 0


# DeepSpeed's Init keywords with nothing to do in Strata when left at their defaults.
_DEEPSPEED_DEFAULTS = {
    "config": None,  # DeepSpeed's older name of config_dict_or_path: read above
    "zero_param_parallel_group": None,
    "sequence_data_parallel_group": None,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "param_swapper": None,
    "tensor_overrides": None,
}
# What each means in DeepSpeed, and why Strata does not take it.
_DEEPSPEED_REFUSED = {
    "zero_param_parallel_group": "hierarchical partitioning (ZeRO++ hpZ) is not implemented: every rank "
    "of the data-parallel group holds a part",
    "sequence_data_parallel_group": "sequence parallelism (Ulysses) is not implemented",
    "zero_quantized_weights": "quantized weight all-gathers (ZeRO++ qwZ) are not implemented",
    "zero_quantized_nontrainable_weights": "quantized frozen weights (ZeRO++) are not implemented",
    "param_swapper": "Strata keeps the parts on the disk itself (offload_param.nvme_path); a "
    "DeepSpeed swapper object cannot drive it",
}


def _check_deepspeed_keywords(keywords: Dict[str, Any]) -> None:
    """DeepSpeed's other Init keywords: accepted at their defaults, refused with the reason
    otherwise; a keyword DeepSpeed does not have either is a TypeError, as Python's."""
    for key, value in keywords.items():
        if key not in _DEEPSPEED_DEFAULTS:
            raise TypeError(f"strata.zero.Init got an unexpected keyword argument {key!r}")
        if key in ("config", "tensor_overrides") or value == _DEEPSPEED_DEFAULTS[key]:
            continue
        raise NotImplementedError(f"strata.zero.Init({key}={value!r}): {_DEEPSPEED_REFUSED[key]}; leave it out")


def _parts_directory(config: Optional[dict], remote_device: Optional[str]) -> Optional[str]:
    """Where Init keeps this rank's parts: a directory (on "nvme") or None (in memory), from
    the config's offload_param as DeepSpeed reads it, and remote_device."""
    devices = {None: None, "none": None, "cpu": "cpu", "nvme": "nvme"}
    if remote_device not in devices:
        raise ValueError(
            f"strata.zero.Init: remote_device {remote_device!r} is not one of 'cpu', 'nvme', 'none' "
            f"(the parts are kept in host memory or on the disk; the engine moves them to the device)"
        )
    wanted = devices[remote_device]
    param = ((config or {}).get("zero_optimization") or {}).get("offload_param") or {}
    configured = devices.get(param.get("device"))
    if wanted is not None and config is not None and configured != wanted:
        raise ValueError(
            f"strata.zero.Init: remote_device={remote_device!r} but the config's "
            f"zero_optimization.offload_param.device is {param.get('device', 'none')!r}: make them the same "
            f"(or leave remote_device out: the config's is used)"
        )
    if (wanted or configured) != "nvme":
        return None
    paths = param.get("nvme_path") or []
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise ValueError(
            "strata.zero.Init: remote_device='nvme' keeps the parts under the config's "
            "zero_optimization.offload_param.nvme_path: pass the config (with offload_param "
            "{\"device\": \"nvme\", \"nvme_path\": DIR}) or use remote_device='cpu'"
        )
    directory = os.fspath(paths[0])
    if not os.path.isdir(directory):
        raise ValueError(
            f"strata.zero.Init: the parts go to offload_param.nvme_path {directory!r}, which is not a "
            f"directory; create it, or keep the parts in memory with remote_device='cpu'"
        )
    return directory


def _subclasses(root: type) -> List[type]:
    """``root`` and every class derived from it, each once."""
    pending, seen = [root], {}
    while pending:
        cls = pending.pop()
        if cls not in seen:
            seen[cls] = None
            pending.extend(cls.__subclasses__())
    return list(seen)


def _patch_constructors(init: Init) -> None:
    """Every torch.nn.Module class's __init__ (and those of classes defined while the
    context is open) wrapped so that the end of an instance's outermost constructor (the
    most derived class's: a subclass's __init__ may still set values after super().__init__)
    partitions the instance's own parameters (Init._built). What to restore goes to
    init._patched."""
    patched = init._patched

    def wrap(cls):
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_strata_wrapped", False):
            return

        def __init__(self, *args, **kwargs):
            outermost = not getattr(self, "_strata_constructing", False)
            if outermost:
                object.__setattr__(self, "_strata_constructing", True)
            try:
                original(self, *args, **kwargs)
            finally:
                if outermost:
                    object.__delattr__(self, "_strata_constructing")
            if outermost and _active is init:
                init._built(self)

        __init__._strata_wrapped = True
        __init__.__wrapped__ = original
        __init__.__doc__ = original.__doc__
        __init__.__name__ = getattr(original, "__name__", "__init__")
        __init__.__qualname__ = getattr(original, "__qualname__", "__init__")
        cls.__init__ = __init__
        patched.append((cls, "__init__", original))

    for cls in _subclasses(torch.nn.Module):
        wrap(cls)
    # Classes defined inside the context.
    original_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        super(torch.nn.Module, cls).__init_subclass__(**kwargs)
        wrap(cls)

    torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
    patched.append((torch.nn.Module, "__init_subclass__", original_subclass))


def _patch_initializers() -> list:
    """torch.nn.Module.apply and transformers' per-module initialization see a module's own
    parameters whole while they run (_materialized)."""
    patched = []
    original_apply = torch.nn.Module.apply

    def apply(self, fn):
        for child in self.children():
            child.apply(fn)
        with _materialized(self):
            fn(self)
        return self

    torch.nn.Module.apply = apply
    patched.append((torch.nn.Module, "apply", original_apply))
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None and "_initialize_weights" in modeling.PreTrainedModel.__dict__:
        original = modeling.PreTrainedModel.__dict__["_initialize_weights"]

        def _initialize_weights(self, module, *args, **kwargs):
            with _materialized(module):
                return original(self, module, *args, **kwargs)

        modeling.PreTrainedModel._initialize_weights = _initialize_weights
        patched.append((modeling.PreTrainedModel, "_initialize_weights", original))
    return patched


# from_pretrained's keyword arguments that need nothing under strata.zero.Init (the hub's,
# for a local directory; what the Auto classes pass on).
_HUB_KWARGS = {"cache_dir", "force_download", "local_files_only", "proxies", "revision", "subfolder", "token",
               "_from_auto", "_commit_hash", "trust_remote_code", "code_revision", "adapter_kwargs",
               "low_cpu_mem_usage", "_fast_init"}
# Passed on to the model's construction.
_BUILD_KWARGS = {"attn_implementation", "experts_implementation"}


def _weights_file(path: str) -> str:
    for name in ("model.safetensors.index.json", "model.safetensors"):
        f = os.path.join(path, name)
        if os.path.isfile(f):
            return f
    present = sorted(os.listdir(path))
    raise FileNotFoundError(
        f"strata.zero.Init: from_pretrained({path!r}) found neither model.safetensors nor "
        f"model.safetensors.index.json there (it holds {present[:8]}); Strata loads safetensors "
        f"checkpoints (convert a pytorch_model.bin with save_pretrained(safe_serialization=True))"
    )


def _local_dir(pretrained_model_name_or_path) -> str:
    if pretrained_model_name_or_path is None:
        raise ValueError("strata.zero.Init: from_pretrained needs a directory")
    path = os.fspath(pretrained_model_name_or_path)
    if not os.path.isdir(path):
        raise ValueError(
            f"strata.zero.Init: from_pretrained({path!r}): not a local directory. Under strata.zero.Init "
            f"a model loads from a directory that save_pretrained wrote (Strata downloads nothing; fetch it "
            f"first, e.g. `hf download MODEL --local-dir DIR`)"
        )
    return path


def _auto_from_pretrained(original):
    """The Auto classes' from_pretrained under strata.zero.Init: the directory checked first
    (before transformers would look for it on the hub), then theirs, which reaches
    _from_pretrained."""

    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        _local_dir(pretrained_model_name_or_path)
        return original.__func__(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    return classmethod(from_pretrained)


def _from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
    """PreTrainedModel.from_pretrained under strata.zero.Init: the model is built from its
    config (parameters on the meta device, as every model under the context), and
    strata.initialize loads the directory's safetensors into the engine's shards, each rank
    reading only its slices (strata.load_safetensors)."""
    from transformers import AutoConfig, GenerationConfig, PretrainedConfig

    if model_args:
        raise TypeError("strata.zero.Init: from_pretrained takes no positional model arguments here")
    path = _local_dir(pretrained_model_name_or_path)
    dtype = kwargs.pop("dtype", None)
    torch_dtype = kwargs.pop("torch_dtype", None)
    dtype = dtype if dtype is not None else torch_dtype
    build = {k: kwargs.pop(k) for k in list(kwargs) if k in _BUILD_KWARGS}
    for k in list(kwargs):
        if k in _HUB_KWARGS:
            kwargs.pop(k)
    weights = _weights_file(path)
    # Keywords naming config attributes (num_labels=3) override the config, as transformers'.
    if not isinstance(config, PretrainedConfig):
        config, kwargs = (cls.config_class or AutoConfig).from_pretrained(
            config if config is not None else path, return_unused_kwargs=True, **kwargs)
    elif any(hasattr(config, k) for k in kwargs):
        config = copy.deepcopy(config)  # the caller's stays as it was
        for k in [k for k in kwargs if hasattr(config, k)]:
            setattr(config, k, kwargs.pop(k))
    if kwargs:
        raise TypeError(
            f"strata.zero.Init: from_pretrained does not take {sorted(kwargs)} here (the model is built from "
            f"its config and its weights loaded by strata.initialize; pass config overrides in `config=`)"
        )
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    # Built without values (the checkpoint's are loaded at initialize), whatever the mode.
    saved_meta = _active.meta if _active is not None else None
    if _active is not None:
        _active.meta = True
    try:
        model = cls._from_config(config, dtype=dtype, **build)
    finally:
        if _active is not None:
            _active.meta = saved_meta
    model.config._name_or_path = path
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen) and getattr(model, "can_generate", lambda: False)():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model._strata_pretrained = weights  # strata.initialize loads it
    missing = _pretrained.missing_parameters(model, weights)
    if missing:  # a new head: the model's own initialization at strata.initialize
        _pretrained.warn_missing(model, path, missing)
        model._strata_missing = missing
    model.eval()
    return model


def _patch_from_pretrained() -> list:
    """Routes transformers' from_pretrained through _from_pretrained while the context is
    open, when transformers is imported (import it before entering the context); returns
    what to restore."""
    if "transformers" not in sys.modules:
        return []  # not imported: nothing to route (importing it would cost ~100 MiB)
    import transformers.modeling_utils as modeling

    owner = modeling.PreTrainedModel
    original = owner.__dict__["from_pretrained"]
    owner.from_pretrained = classmethod(_from_pretrained)
    patched = [(owner, "from_pretrained", original)]
    # Each Auto class (AutoModelForCausalLM, ...) holds its own copy of the function.
    import transformers.models.auto.auto_factory as auto
    import transformers.models.auto.modeling_auto  # noqa: F401  (defines the Auto classes)

    for cls in _subclasses(auto._BaseAutoModelClass):
        original = cls.__dict__.get("from_pretrained")
        if original is not None:
            cls.from_pretrained = _auto_from_pretrained(original)
            patched.append((cls, "from_pretrained", original))
    return patched


class _Open:
    """A parameter gathered by GatheredParameters: its engine, where the engine holds it,
    how many contexts hold it and the rank whose changes are written back."""

    __slots__ = ("param", "engine", "ref", "depth", "modifier")

    def __init__(self, param, engine, ref):
        self.param = param
        self.engine = engine
        self.ref = ref  # (group, index)
        self.depth = 1
        self.modifier = None


_open: Dict[int, _Open] = {}


def _engine_of(param):
    """The engine that manages ``param`` and where it holds it, or (None, None)."""
    ref = getattr(param, "_strata_engine", None)
    engine = ref() if ref is not None else None
    where = engine._find(param) if engine is not None else None
    return (engine, where) if where is not None else (None, None)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's ``deepspeed.zero.register_external_parameter``: ``parameter`` is used
    outside its own module's forward (``F.linear(x, self.linear1.weight)`` in the parent's,
    or returned by it). Call it before ``strata.initialize`` (in the module's ``__init__``,
    as DeepSpeed's docs do): the engine then keeps the parameter in the root group, whole
    from the start of every forward to the end of its backward (as it keeps tied weights),
    so every module sees it. After initialize it is refused, unless the parameter is there
    already."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"strata.zero.register_external_parameter: expected a torch.nn.Parameter, got "
                        f"{type(parameter).__name__}")
    engine, where = _engine_of(parameter)
    if engine is not None:
        if engine._groups[where[0]].module is None:
            return  # in the root group already: whole throughout every step
        raise RuntimeError(
            f"strata.zero.register_external_parameter: parameter {engine._groups[where[0]].names[where[1]]} is "
            f"in the engine's group {engine._groups[where[0]].name}, whole only inside that module's forward: "
            f"register it before strata.initialize (in the module's __init__), so the engine keeps it whole "
            f"throughout"
        )
    parameter._strata_external = True


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undoes register_external_parameter (before strata.initialize)."""
    if getattr(parameter, "_strata_external", False):
        del parameter._strata_external


class GatheredParameters:
    """Context manager (DeepSpeed's ``deepspeed.zero.GatheredParameters``): inside it the
    listed parameters of a Strata engine are whole on every rank, in the working dtype (on
    the compute device); a collective, entered and left by every rank with the same list.

        with strata.zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
            if engine.rank == 0:
                model.lm_head.weight[:10].zero_()

    ``modifier_rank``: on leaving, that rank's values are written back into the engine
    (the fp32 master the optimizer updates, and the working shards) on every rank;
    elements it left unchanged keep their fp32 master value exactly (in bf16 or fp16 only
    the changed elements are rounded). None: changes are dropped. Leave at a step boundary
    (before training or right after ``step()``). The shape must stay (resizing, e.g.
    ``resize_token_embeddings``, happens before ``strata.initialize``). Leaving by an
    exception writes nothing back.

    ``params``: a parameter or an iterable of them; parameters no engine manages (left
    out of ``model_parameters``, or not under ``strata.initialize`` yet) are whole
    already and are left as they are, but for those strata.zero.Init partitioned: before
    ``strata.initialize`` their parts are gathered whole (DeepSpeed's "fill on rank 0 in
    the constructor" recipe; strata/_part_gather.py: over torch.distributed when they span
    several ranks), the modifier's values cut back into every rank's part on leaving.
    Nested contexts: a parameter already gathered stays as the outer context gave it, and
    is written back when the outermost context that gathered it exits (with the first
    ``modifier_rank`` given to any of them). ``fwd_module``: accepted for DeepSpeed's
    signature and ignored (a parameter used outside its module's forward is registered with
    register_external_parameter before ``strata.initialize``). No engine
    forward runs inside the context. ``enabled=False``: nothing happens.
    """

    def __init__(self, params, modifier_rank: Optional[int] = None, fwd_module=None, enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        elif params is None:
            params = []
        else:
            params = list(params)
        if modifier_rank is not None and (not isinstance(modifier_rank, int) or modifier_rank < 0):
            raise ValueError(f"strata.zero.GatheredParameters: modifier_rank must be a rank or None, got {modifier_rank!r}")
        self.params = params
        self.modifier_rank = modifier_rank
        self.enabled = enabled
        self._entries: List[_Open] = []  # the parameters this context holds (gathered or nested)
        self._parts: Optional[_part_gather.GatheredParts] = None  # strata.zero.Init's, before initialize

    def __enter__(self):
        if not self.enabled:
            return None
        new, seen, parts = {}, set(), []
        for p in self.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            engine, ref = _engine_of(p)
            if engine is None:
                if partitioned(p) is not None:
                    parts.append(p)  # built by strata.zero.Init, not in an engine yet
                continue
            if self.modifier_rank is not None and self.modifier_rank >= engine.world_size:
                raise ValueError(
                    f"strata.zero.GatheredParameters: modifier_rank {self.modifier_rank} is not a rank "
                    f"of the engine's {engine.world_size}"
                )
            entry = _open.get(id(p))
            if entry is not None:
                entry.depth += 1
            else:
                entry = _Open(p, engine, ref)
                new.setdefault(id(engine), []).append(entry)
            if entry.modifier is None:
                entry.modifier = self.modifier_rank
            self._entries.append(entry)
        if parts:
            self._parts = _part_gather.GatheredParts(parts, self.modifier_rank)
            self._parts.__enter__()
        for entries in new.values():
            entries[0].engine._gather_whole([e.param for e in entries])
            for e in entries:
                _open[id(e.param)] = e
        return None

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.enabled:
            return
        closing = []
        for e in self._entries:
            e.depth -= 1
            if e.depth == 0:
                closing.append(e)
        self._entries = []
        by_engine: Dict[int, List[_Open]] = {}
        for e in closing:
            by_engine.setdefault(id(e.engine), []).append(e)
            del _open[id(e.param)]
        for entries in by_engine.values():
            _close(entries, write=exc_type is None)
        if self._parts is not None:
            parts, self._parts = self._parts, None
            parts.__exit__(exc_type, exc, tb)


def _close(entries: List[_Open], write: bool) -> None:
    """Gives one engine's closing parameters back, each modifier rank's changes written into
    every rank's master and shards (the same calls, in the same order, on every rank);
    leaving by an exception writes nothing."""
    engine = entries[0].engine
    modifiers = sorted({e.modifier for e in entries if e.modifier is not None}) if write else []
    for m in modifiers:
        engine._release_whole(sorted(e.ref for e in entries if e.modifier == m), m)
    rest = sorted(e.ref for e in entries if not write or e.modifier is None)
    if rest:
        engine._release_whole(rest, None)
