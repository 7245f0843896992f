"""Reading safetensors files without the ``safetensors`` package (the wheel needs only torch):
a file's header, and a file of floating-point tensors as CPU tensors."""

from __future__ import annotations

import collections
import json
import struct

import torch

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def header(f) -> dict:
    """The header of the safetensors file open as ``f`` (binary, at its start): {name: {dtype,
    shape, data_offsets}} and "__metadata__"; ``f`` is left at the first byte of the data."""
    (size,) = struct.unpack("<Q", f.read(8))
    return json.loads(f.read(size))


def load(path: str) -> "collections.OrderedDict[str, torch.Tensor]":
    """Every tensor of the file, in file order, as views of one buffer read whole (the file's
    size in memory, no second copy)."""
    with open(path, "rb") as f:
        head = header(f)
        data = bytearray(f.read())
    out = collections.OrderedDict()
    for name, info in head.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, not a floating-point one")
        begin, end = info["data_offsets"]
        count = (end - begin) // torch.empty(0, dtype=dtype).element_size()
        out[name] = torch.frombuffer(data, dtype=dtype, count=count, offset=begin).reshape(info["shape"])
    return out
