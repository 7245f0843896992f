"""``strata.utils.zero_to_fp32``: DeepSpeed's ``deepspeed.utils.zero_to_fp32`` calls on a Strata
checkpoint: the model's fp32 values consolidated from every rank's files, streamed by
``strata-ckpt export`` (its memory does not grow with the model; the CRC of every tensor
checked first).

- ``get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None)``: the state dict
- ``load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None)``: into ``model``
- ``convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, ...)``: a file

Run as a script, as DeepSpeed's ``zero_to_fp32.py``:
``python -m strata.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--tag TAG]``.

Different by design: the output is safetensors (``model.safetensors``), never a pickle, so
``safe_serialization=False`` writes safetensors too, with a log line; it is one file
(``strata-ckpt export --hf`` writes Hugging Face shards); ``exclude_frozen_parameters`` is
refused (the frozen values are the model's base: export them, or take the trained ones by
name).
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Optional

from .. import _safetensors

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict"]

_PACKAGE = pathlib.Path(__file__).resolve().parent.parent


def _tool() -> str:
    """strata-ckpt: the wheel's (strata/bin), a CMake build's (<build>/bin beside
    <build>/python/strata), or the one on PATH."""
    for candidate in (_PACKAGE / "bin" / "strata-ckpt", _PACKAGE.parent.parent / "bin" / "strata-ckpt"):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("strata-ckpt")
    if found is None:
        raise FileNotFoundError(
            "strata.utils.zero_to_fp32: the strata-ckpt tool was not found (strata/bin in the wheel, "
            "<build>/bin in a CMake build, or on PATH): install strata from its wheel or put the tool on PATH"
        )
    return found


def _export(checkpoint_dir, out_file: str, tag: Optional[str], exclude_frozen_parameters: bool) -> None:
    if exclude_frozen_parameters:
        raise NotImplementedError(
            "strata.utils.zero_to_fp32: exclude_frozen_parameters is not supported: the export holds every "
            "parameter (the frozen ones are the model's base); take the trained ones by name from the result"
        )
    cmd = [_tool(), "export", os.fspath(checkpoint_dir), "--safetensors", out_file, "--dtype", "fp32"]
    if tag:
        cmd += ["--tag", str(tag)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"strata.utils.zero_to_fp32: {' '.join(cmd)} failed: {(done.stderr or done.stdout).strip()}")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False, lazy_mode: bool = False):
    """The checkpoint's fp32 parameters, by the model's names (an OrderedDict of CPU tensors;
    the tag ``latest`` names when ``tag`` is None). ``lazy_mode`` is accepted and changes
    nothing (the values are read once, whole)."""
    with tempfile.TemporaryDirectory(prefix="strata-zero-to-fp32-") as tmp:
        out = os.path.join(tmp, "model.safetensors")
        _export(checkpoint_dir, out, tag, exclude_frozen_parameters)
        return _safetensors.load(out)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag: Optional[str] = None):
    """``model`` moved to the CPU with the checkpoint's fp32 values loaded (strict=False, as
    DeepSpeed's); returns it. Not a model an engine holds: build it anew."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Writes ``output_dir/model.safetensors`` (the module docstring says how it differs);
    returns its path."""
    if not safe_serialization:
        logging.getLogger("strata").info(
            "strata.utils.zero_to_fp32: writing safetensors (Strata writes no pickles), not pytorch_model.bin")
    if max_shard_size != "5GB":
        logging.getLogger("strata").info(
            "strata.utils.zero_to_fp32: one file, max_shard_size=%s not applied (strata-ckpt export --hf "
            "writes shards)", max_shard_size)
    os.makedirs(output_dir, exist_ok=True)
    out = os.path.join(os.fspath(output_dir), "model.safetensors")
    _export(checkpoint_dir, out, tag, exclude_frozen_parameters)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m strata.utils.zero_to_fp32",
                                     description="A Strata checkpoint's fp32 model as output_dir/model.safetensors")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir")
    parser.add_argument("-t", "--tag", default=None)
    parser.add_argument("--max_shard_size", default="5GB")
    parser.add_argument("--safe_serialization", action="store_true")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    args = parser.parse_args(argv)
    try:
        path = convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir, args.max_shard_size,
                                                          args.safe_serialization, args.tag,
                                                          args.exclude_frozen_parameters)
    except (RuntimeError, NotImplementedError, FileNotFoundError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
