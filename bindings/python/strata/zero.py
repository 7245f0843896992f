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

import os
import sys
from typing import Any, Dict, List, Mapping, Optional, Union

import torch
from torch.nn.modules.module import register_module_parameter_registration_hook

__all__ = ["Init", "GatheredParameters"]

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
        self._patched = _patch_from_pretrained()
        return self

    def __exit__(self, *exc) -> None:
        global _active
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            _active = False
        for owner, name, original in getattr(self, "_patched", []):
            setattr(owner, name, original)
        self._patched = []


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
    if kwargs:
        raise TypeError(
            f"strata.zero.Init: from_pretrained does not take {sorted(kwargs)} here (the model is built from "
            f"its config and its weights loaded by strata.initialize; pass config overrides in `config=`)"
        )
    weights = _weights_file(path)
    if not isinstance(config, PretrainedConfig):
        config = (cls.config_class or AutoConfig).from_pretrained(config if config is not None else path)
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    model = cls._from_config(config, dtype=dtype, **build)
    model.config._name_or_path = path
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen) and getattr(model, "can_generate", lambda: False)():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model._strata_pretrained = weights  # strata.initialize loads it
    model.eval()
    return model


def _patch_from_pretrained() -> list:
    """Routes transformers' from_pretrained through _from_pretrained while the context is
    open (when transformers is imported); returns what to restore."""
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        try:
            import transformers.modeling_utils as modeling  # noqa: F811
        except ImportError:
            return []
    owner = modeling.PreTrainedModel
    original = owner.__dict__["from_pretrained"]
    owner.from_pretrained = classmethod(_from_pretrained)
    patched = [(owner, "from_pretrained", original)]
    # Each Auto class (AutoModelForCausalLM, ...) holds its own copy of the function.
    import transformers.models.auto.auto_factory as auto
    import transformers.models.auto.modeling_auto  # noqa: F401  (defines the Auto classes)

    pending, seen = [auto._BaseAutoModelClass], set()
    while pending:
        cls = pending.pop()
        if cls in seen:
            continue
        seen.add(cls)
        pending.extend(cls.__subclasses__())
        original = cls.__dict__.get("from_pretrained")
        if original is not None:
            cls.from_pretrained = _auto_from_pretrained(original)
            patched.append((cls, "from_pretrained", original))
    return patched


class _Open:
    """A parameter gathered by GatheredParameters: what it held before and what it was
    given (the working dtype's values, and the fp32 master they came from)."""

    __slots__ = ("param", "engine", "ref", "depth", "modifier", "saved", "given", "master")

    def __init__(self, param, engine, ref):
        self.param = param
        self.engine = engine
        self.ref = ref  # (group, index)
        self.depth = 1
        self.modifier = None
        self.saved = None
        self.given = None
        self.master = None


_open: Dict[int, _Open] = {}


def _engine_of(param):
    ref = getattr(param, "_strata_ref", None)
    if ref is None:
        return None, None
    engine = ref[0]()
    if engine is None or getattr(engine, "_core", None) is None:
        return None, None
    return engine, (ref[1], ref[2])


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
    already and are left as they are. Nested contexts: a parameter already gathered stays
    as the outer context gave it, and is written back when the outermost context that
    gathered it exits (with the first ``modifier_rank`` given to any of them).
    ``fwd_module``: accepted for DeepSpeed's signature; Strata needs no registration of
    parameters used outside their module (it keeps them in the root group). No engine
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

    def __enter__(self):
        if not self.enabled:
            return None
        new, seen = {}, set()
        for p in self.params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            engine, ref = _engine_of(p)
            if engine is None:
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
        for entries in new.values():
            engine = entries[0].engine
            values = engine._gather_params(sorted(e.ref for e in entries))
            with torch.no_grad():
                for e in entries:
                    e.master = values[e.ref]
                    e.saved = e.param.data
                    e.param.data = e.master.to(device=engine.device, dtype=engine._compute)
                    e.given = e.param.data.clone() if engine._compute != torch.float32 else None
                    _open[id(e.param)] = e
            engine._gathered_open += 1
        self._opened_engines = [entries[0].engine for entries in new.values()]
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
        try:
            for entries in by_engine.values():
                _close(entries, write=exc_type is None)
        finally:
            for engine in self._opened_engines:
                engine._gathered_open -= 1
            self._opened_engines = []


def _close(entries: List[_Open], write: bool) -> None:
    """Writes back the closing parameters of one engine (their modifier ranks' changes) and
    gives every parameter back what it held."""
    engine = entries[0].engine
    entries = sorted(entries, key=lambda e: e.ref)
    modifiers = sorted({e.modifier for e in entries if e.modifier is not None})
    writes = []
    if write:
        for m in modifiers:
            mine = [e for e in entries if e.modifier == m]
            check, buffers = "", []
            with torch.no_grad():
                for e in mine:
                    name = engine._param_entry(*e.ref).name
                    numel = e.master.numel()
                    if engine.rank != m:
                        buffers.append(torch.empty(numel, dtype=torch.float32))
                        continue
                    now = e.param.data
                    if tuple(now.shape) != tuple(e.master.shape):
                        check = check or (
                            f"parameter {name} changed shape inside strata.zero.GatheredParameters "
                            f"({tuple(e.master.shape)} -> {tuple(now.shape)}); the engine's layout is fixed: "
                            f"resize (resize_token_embeddings, say) before strata.initialize"
                        )
                        buffers.append(torch.empty(numel, dtype=torch.float32))
                        continue
                    now = now.detach().to("cpu")
                    if e.given is not None:
                        # Unchanged elements keep their fp32 master value exactly.
                        changed = now != e.given.to("cpu")
                        merged = torch.where(changed, now.float(), e.master)
                    else:
                        merged = now.float()
                    buffers.append(merged.reshape(-1).contiguous())
            writes.append((m, mine, check, buffers))
    for e in entries:
        e.param.data = e.saved
        e.saved = e.given = None
    for m, mine, check, buffers in writes:
        engine._core.set_parameters(
            m, [(e.ref[0], e.ref[1], b.data_ptr(), b.numel()) for e, b in zip(mine, buffers)], check
        )
    for e in entries:
        e.master = None
