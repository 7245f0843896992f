"""Where ``strata.zero.Init(remote_device="nvme")`` keeps this rank's parts: one file under
the config's ``offload_param.nvme_path``, unlinked as soon as it is made (nothing is left
behind by a crash), each part a shared mapping of its own page-aligned range. Once a part
is written its pages are written back and dropped (msync, madvise DONTNEED, then
posix_fadvise DONTNEED), so neither the process nor the page cache holds it, and when it is freed its range of the
file is punched out: building a
model whose parts exceed the memory limit holds about one module whole, and
``strata.initialize`` reads each part back from the disk as it assembles it.

The mappings are made with libc's mmap through ctypes, not Python's ``mmap`` module, which
duplicates the file descriptor per mapping (a model has thousands of parameters, a
process a limit on open files); one descriptor is kept for the file and closed when the
last part is gone."""

from __future__ import annotations

import ctypes
import mmap
import os
import tempfile
import weakref

import torch

_PAGE = mmap.PAGESIZE
_MS_SYNC = 4  # <sys/mman.h> on Linux
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE


def _check(rc: int, what: str, directory: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"strata.zero.Init: {what} of a part in {directory} failed: {os.strerror(err)}")


class PartFile:
    """One rank's parts on the disk (the module docstring)."""

    def __init__(self, directory: str):
        self.directory = directory
        fd, path = tempfile.mkstemp(prefix=f"strata_init_parts_{os.getpid()}_", dir=directory)
        os.unlink(path)
        self._fd = fd
        self._end = 0
        self.bytes = 0  # what the parts alive take on the disk
        self._closer = weakref.finalize(self, os.close, fd)

    def keep(self, values: torch.Tensor) -> torch.Tensor:
        """A tensor backed by this file holding ``values`` (flat, contiguous), its pages
        already on the disk and out of memory."""
        nbytes = values.numel() * values.element_size()
        if nbytes == 0:
            return values.clone()
        offset = self._end
        try:
            os.posix_fallocate(self._fd, offset, nbytes)
        except OSError as e:
            raise OSError(
                e.errno,
                f"strata.zero.Init(remote_device='nvme'): no room for {nbytes} more bytes of parts in "
                f"{self.directory} (offload_param.nvme_path; {self.bytes} bytes kept there so far): "
                f"{e.strerror}; free space there or choose another nvme_path",
            ) from None
        self._end = offset + (nbytes + _PAGE - 1) // _PAGE * _PAGE
        self.bytes += nbytes
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        addr = _libc.mmap(None, nbytes, prot, mmap.MAP_SHARED, self._fd, offset)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            # The range goes back (punched out) before the error: nothing kept for nothing.
            _libc.fallocate(self._fd, _PUNCH_HOLE, offset, self._end - offset)
            self.bytes -= nbytes
            raise OSError(err, f"strata.zero.Init: mmap of a part in {self.directory} failed: {os.strerror(err)}")
        buf = (ctypes.c_ubyte * nbytes).from_address(addr)
        # The mapping lives as long as the buffer, which the tensor holds; the file as long
        # as any of its parts (each finalizer holds this object).
        release = weakref.finalize(buf, self._release, addr, offset, nbytes)
        release.atexit = False  # at exit the mappings go with the process (a tensor may still point there)
        part = torch.frombuffer(buf, dtype=values.dtype, count=values.numel())
        part._strata_part_file = (self, offset, nbytes)
        part.copy_(values.reshape(-1))
        self.settle(part)
        return part

    def _release(self, addr: int, offset: int, nbytes: int) -> None:
        """A part is gone: its mapping, and its range of the file (a hole punched: the disk
        goes back as strata.initialize consumes the parts, or where a parameter was
        replaced while the model was built)."""
        _libc.munmap(addr, nbytes)
        _libc.fallocate(self._fd, _PUNCH_HOLE, offset, (nbytes + _PAGE - 1) // _PAGE * _PAGE)
        self.bytes -= nbytes

    def settle(self, part: torch.Tensor) -> None:
        """``part``'s pages written back and dropped (after a write into it)."""
        _, offset, nbytes = part._strata_part_file
        addr = part.data_ptr()
        _check(_libc.msync(addr, nbytes, _MS_SYNC), "msync", self.directory)
        _check(_libc.madvise(addr, nbytes, mmap.MADV_DONTNEED), "madvise", self.directory)
        os.posix_fadvise(self._fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def file_of(part: torch.Tensor):
    """The PartFile backing ``part`` (None: it is in memory)."""
    entry = getattr(part, "_strata_part_file", None)
    return entry[0] if entry is not None else None
