"""The model in and out of the engine from Python: its parameters gathered, initial weights
from safetensors files, and the Hugging Face layout (``save_16bit_model``,
``save_pretrained``, a PEFT model's adapters). The engine (engine/libtorch/tensor_engine.h)
gathers, converts and writes; what is Python's is which tensors go under which names:
``state_dict``'s, transformers' tied weights, PEFT's choice of adapter weights."""

from __future__ import annotations

import collections
import copy
import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Union

import torch

from . import _strata


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


class ModelIOMixin:
    """The model's weights in and out of strata.engine.Engine."""

    def gather_parameters(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Collective: every parameter's fp32 master value, by name (every rank gets all)."""
        named = list(self.module.named_parameters())
        values = self._core.gather_parameters([p for _, p in named])
        return collections.OrderedDict((name, v) for (name, _), v in zip(named, values))

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
        self._core.load_safetensors(os.fspath(path), self._whole_tensors())
        self._needs_load = False

    def _saved_names(self, exclude_frozen_parameters: bool) -> Dict[int, str]:
        """{id(tensor): the name the model is saved under}: ``state_dict()``'s names and
        order, each tensor once (tied weights: the name ``save_pretrained`` keeps, not the
        one a transformers model lists as tied to another), non-persistent buffers left out,
        frozen parameters too when asked."""
        tied = getattr(self.module, "_tied_weights_keys", None)
        tied_targets = set(tied) if isinstance(tied, (dict, list, tuple, set)) else set()
        frozen = {id(p) for g in self._groups if g.frozen for p in g.params}
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

    def _save(self, save_dir, filename: str, limit: int, saved: Dict[int, str], whole: list, files) -> dict:
        """The engine's save of the model: each managed parameter under its name in `saved`
        (left out without one), and `whole` [(name, tensor)] from rank 0."""
        names = [[saved.get(id(p), "") for p in g.params] for g in self._groups]
        return self._core.save_model(os.fspath(save_dir), filename, limit, names, whole, list(files))

    def save_16bit_model(self, save_dir: Union[str, os.PathLike], save_filename: str = "model.safetensors",
                         max_shard_size: Union[int, str] = "5GB", exclude_frozen_parameters: bool = False,
                         _files: Sequence[tuple] = ()) -> dict:
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
        whole = [(name, t) for name, t in self.module.state_dict(keep_vars=True).items()
                 if id(t) not in self._managed and saved.get(id(t)) == name]
        return self._save(save_dir, save_filename, limit, saved, whole, _files)

    def save_pretrained(self, save_directory: Union[str, os.PathLike], max_shard_size: Union[int, str] = "5GB",
                        safe_serialization: bool = True, exclude_frozen_parameters: bool = False, **kwargs) -> dict:
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
        return self.save_16bit_model(save_directory, "model.safetensors", max_shard_size, exclude_frozen_parameters,
                                     _files=files)

    def _save_adapters(self, save_directory: Union[str, os.PathLike], selected_adapters: Optional[Sequence[str]] = None,
                       save_embedding_layers: Union[str, bool] = "auto", is_main_process: bool = True,
                       **kwargs) -> dict:
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
        results = []
        for adapter in adapters:
            picked = get_peft_model_state_dict(model, state_dict=markers, adapter_name=adapter,
                                               save_embedding_layers=save_embedding_layers)
            saved = {}
            for name, m in picked.items():
                if id(m) not in of_marker:
                    raise ValueError(
                        f"strata: engine.save_pretrained: PEFT computes the saved {name} from the weights "
                        f"({model.peft_config[adapter].peft_type}); Strata saves adapters whose weights "
                        f"are parameters or buffers of the model"
                    )
                saved.setdefault(id(of_marker[id(m)]), name)  # a tensor once (safetensors: no aliases)
            whole = [(name, by_id[key]) for key, name in saved.items() if key not in self._managed]
            out_dir = os.fspath(save_directory)
            if adapter != "default":
                out_dir = os.path.join(out_dir, adapter)
            files = [("adapter_config.json", _adapter_config_json(model, adapter))]
            results.append(self._save(out_dir, "adapter_model.safetensors", 1 << 62, saved, whole, files))
        return results[0] if len(results) == 1 else dict(zip(adapters, results))
