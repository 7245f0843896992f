"""strata.io: asynchronous file I/O for CPU tensors through Strata's swap engine.

``AioHandle`` is the swap tier's I/O engine (io_uring, or the synchronous engine where
io_uring is unavailable) behind a handle in the manner of DeepNVMe's aio handle;
``empty_aligned`` gives 4 KiB-aligned, page-locked (where the memlock limit allows)
tensors that O_DIRECT I/O needs. See docs/python.md.
"""

from __future__ import annotations

import os
from typing import Union

import torch

from . import _strata

__all__ = ["AioHandle", "empty_aligned", "is_aligned", "ALIGNMENT"]

ALIGNMENT = 4096
PathLike = Union[str, os.PathLike]


def empty_aligned(numel: int, dtype: torch.dtype = torch.float32, pin: bool = True) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements at a 4096-byte aligned address, zero-filled.

    The memory is page-locked with mlock when ``pin`` and RLIMIT_MEMLOCK allow (it is
    not an error when the limit refuses). The tensor keeps its memory alive; reshape it
    with ``.view(...)``.
    """
    if numel < 0:
        raise ValueError(f"strata.io.empty_aligned: numel must be >= 0, got {numel}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = _strata.AlignedBuffer(numel * itemsize, pin)
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    t = torch.frombuffer(buf, dtype=dtype, count=numel)
    return t


def is_aligned(t: torch.Tensor, alignment: int = ALIGNMENT) -> bool:
    """Whether ``t``'s data starts at a multiple of ``alignment`` bytes."""
    return t.data_ptr() % alignment == 0


def _check(t: torch.Tensor, what: str) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"strata.io.{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"strata.io.{what}: the tensor is on {t.device}; it must be a CPU tensor")
    if not t.is_contiguous():
        raise ValueError(f"strata.io.{what}: the tensor is not contiguous")
    return t.numel() * t.element_size()


class AioHandle:
    """Asynchronous reads and writes of whole CPU tensors from/to files.

    ``block_size``: bytes per I/O request (a multiple of 4096; a tensor is split in
    requests of this size); ``queue_depth``: requests in flight per ring/thread;
    ``threads``: io_uring rings (or worker threads); ``direct``: open files with O_DIRECT
    where the filesystem allows it (otherwise buffered I/O, see ``fallback``). With
    ``direct=True`` every tensor's address, file offset and byte length must be multiples
    of 4096 (use ``empty_aligned``): ValueError otherwise, on every filesystem.
    ``engine``: "auto" (io_uring when available), "io_uring" or "sync".

    ``async_pwrite``/``async_pread`` queue an operation and return at once; the tensor
    must stay untouched until ``wait()``, which returns the number of operations that
    ended and raises the first error (OSError for I/O errors) after all of them ended.
    ``sync_pwrite``/``sync_pread`` do one operation and wait (also for any earlier
    ones); they return the bytes moved. A write creates the file if needed and never
    truncates it.
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 16,
        threads: int = 1,
        direct: bool = True,
        engine: str = "auto",
    ):
        self._h = _strata.AioHandle(int(block_size), int(queue_depth), int(threads), bool(direct), engine)
        self._keep: list = []

    # DeepNVMe-style accessors.
    def get_block_size(self) -> int:
        return self._h.block_size

    def get_queue_depth(self) -> int:
        return self._h.queue_depth

    def get_thread_count(self) -> int:
        return self._h.threads

    @property
    def block_size(self) -> int:
        return self._h.block_size

    @property
    def queue_depth(self) -> int:
        return self._h.queue_depth

    @property
    def threads(self) -> int:
        return self._h.threads

    @property
    def direct(self) -> bool:
        return self._h.direct

    @property
    def engine(self) -> str:
        """The engine in use: "io_uring" or "sync"."""
        return self._h.engine

    @property
    def fallback(self) -> str:
        """Why O_DIRECT or io_uring was not used ("" when everything was as asked)."""
        return self._h.fallback

    @property
    def pending(self) -> int:
        """Operations submitted and not yet waited for."""
        return self._h.pending

    def _submit(self, write: bool, tensor: torch.Tensor, path: PathLike, offset: int) -> int:
        what = "async_pwrite" if write else "async_pread"
        nbytes = _check(tensor, what)
        if offset < 0:
            raise ValueError(f"strata.io.{what}: offset must be >= 0, got {offset}")
        n = self._h.submit(write, tensor.data_ptr() if nbytes else 0, nbytes, os.fspath(path), int(offset))
        if n:
            self._keep.append(tensor)
        return n

    def async_pwrite(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> int:
        """Queues writing ``tensor``'s bytes to ``path`` at ``offset``; returns the requests."""
        return self._submit(True, tensor, path, offset)

    def async_pread(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> int:
        """Queues reading ``tensor.nbytes`` bytes of ``path`` at ``offset`` into ``tensor``."""
        return self._submit(False, tensor, path, offset)

    def wait(self) -> int:
        """Waits for every queued operation; returns how many ended. Raises the first error."""
        try:
            return self._h.wait()
        finally:
            self._keep.clear()

    def sync_pwrite(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> int:
        self.async_pwrite(tensor, path, offset)
        self.wait()
        return tensor.numel() * tensor.element_size()

    def sync_pread(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> int:
        self.async_pread(tensor, path, offset)
        self.wait()
        return tensor.numel() * tensor.element_size()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.pending:
            self.wait()
        return False
