"""Strata: train models larger than accelerator memory (ZeRO-3 with CPU and NVMe offload).

- ``strata.initialize(model=..., config=...)``: the ZeRO-3 engine for a torch.nn.Module,
  DeepSpeed's calling convention (``engine, optimizer, _, scheduler``).
- ``strata.load_safetensors(engine, path)``: initial weights from safetensors files, each
  rank reading only its slices; ``strata.zero.Init``: build a model with no rank holding it
  whole (its values kept, partitioned as built; or ``meta=True``), ``from_pretrained`` under
  it loading each rank's slices; ``strata.zero.GatheredParameters``: parameters whole for a
  while; ``engine.save_pretrained`` / ``save_16bit_model``: the Hugging Face layout
  (docs/huggingface.md).
- ``strata.checkpointing.checkpoint(fn, *args)``: activation checkpointing that honours the
  config's ``activation_checkpointing.cpu_checkpointing`` (torch.utils.checkpoint works too).
- ``strata.optim.CPUAdam``: a torch.optim.Optimizer on the SIMD CPU Adam kernel.
- ``strata.io``: asynchronous file I/O of CPU tensors through the swap engine.
- ``strata.nvme_bench(...)``: the swap-tier bandwidth sweep, as a dict.
- ``strata.validate_config``, ``parse_bytes``, ``format_bytes``, ``topology``.

Errors from C++ arrive as ValueError (bad arguments or configuration), OSError and its
subclasses (I/O), RuntimeError otherwise, with the C++ message (docs/python.md).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Union

import torch  # noqa: F401  (loads LibTorch before the extension that links it)

from . import _build_info


def _check_torch() -> None:
    """Refuses a torch other than the one the extension was built against: its C++ ABI is
    not stable across releases (or CUDA builds), so loading _strata would fail on an
    undefined symbol, or worse, not fail."""
    built, built_cuda = _build_info.TORCH_VERSION, _build_info.TORCH_CUDA
    found, found_cuda = torch.__version__, torch.version.cuda or ""
    if found.split("+")[0] != built.split("+")[0] or found_cuda != built_cuda:
        def describe(version: str, cuda: str) -> str:
            return f"torch {version} ({'CUDA ' + cuda if cuda else 'CPU-only'})"
        raise ImportError(
            f"strata {_build_info.STRATA_VERSION} was built against {describe(built, built_cuda)} "
            f"but this environment has {describe(found, found_cuda)} "
            f"(at {os.path.dirname(torch.__file__)}). Install the torch it was built for "
            f"(pip install torch=={built.split('+')[0]}) or rebuild strata against this one "
            "(pip install . from the checkout; docs/install.md)."
        )


_check_torch()

from . import _strata  # noqa: E402

__version__ = _strata.__version__

parse_bytes = _strata.parse_bytes
format_bytes = _strata.format_bytes
training_flops_per_token = _strata.training_flops_per_token
datasheet_peak_flops = _strata.datasheet_peak_flops


def throughput(flops_per_token: float, tokens: float, seconds: float, ranks: int = 1,
               peak_flops_per_rank: float = 0.0) -> dict:
    """Tokens/s, model FLOP/s, TFLOPS and MFU of ``tokens`` trained in ``seconds`` by ``ranks``
    ranks, each with a peak of ``peak_flops_per_rank`` FLOP/s (0: unknown, MFU 0).

    The same definition strata-train reports (core/throughput.h): model FLOPs per token from
    ``training_flops_per_token(params, n_layers, seq_len, d_model)``.
    """
    return _strata.throughput(flops_per_token, tokens, seconds, ranks, peak_flops_per_rank)


class ConfigError(ValueError):
    """An invalid configuration. ``errors`` lists every problem as "path: message"."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        noun = "error" if len(errors) == 1 else "errors"
        super().__init__(f"invalid configuration ({len(errors)} {noun}):\n" + "\n".join(errors))


def validate_config(
    config: Union[Mapping[str, Any], str, os.PathLike], world_size: int = 1
) -> dict:
    """Validates a DeepSpeed-style config and returns it with every default filled in.

    ``config`` is a dict, a JSON string, or a path to a JSON file. Raises ConfigError
    listing every error (unknown keys with suggestions, wrong types and ranges, keys
    Strata does not support, inconsistent batch sizes).
    """
    if isinstance(config, Mapping):
        text = json.dumps(config)
    elif isinstance(config, os.PathLike) or (
        isinstance(config, str) and not config.lstrip().startswith("{")
    ):
        with open(config, encoding="utf-8") as f:
            text = f.read()
    else:
        text = config
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    normalized, errors = _strata.validate_config(text, world_size)
    if errors:
        raise ConfigError(errors)
    return json.loads(normalized)


def topology() -> str:
    """The machine's NUMA nodes, cores, memory, GPUs and NVMe drives (hwloc)."""
    return _strata.topology()


from . import checkpointing, io, optim, zero  # noqa: E402
from .bench import nvme_bench  # noqa: E402
from ._initialize import initialize, load_safetensors  # noqa: E402
from .engine import Engine  # noqa: E402

__all__ = [
    "ConfigError",
    "Engine",
    "initialize",
    "io",
    "load_safetensors",
    "nvme_bench",
    "optim",
    "validate_config",
    "zero",
    "checkpointing",
    "parse_bytes",
    "format_bytes",
    "topology",
    "training_flops_per_token",
    "throughput",
    "datasheet_peak_flops",
]
