"""strata.io: the aio handle over the swap engine and aligned tensors."""

import errno
import gc
import os

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")


def test_empty_aligned():
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.float64):
        t = strata.io.empty_aligned(12345, dtype)
        assert t.dtype == dtype and t.numel() == 12345 and t.device.type == "cpu"
        assert strata.io.is_aligned(t)
        assert torch.count_nonzero(t) == 0
    assert strata.io.empty_aligned(0).numel() == 0
    # The tensor keeps its memory alive.
    t = strata.io.empty_aligned(1 << 16)
    t.fill_(3.0)
    gc.collect()
    junk = [strata.io.empty_aligned(1 << 16).fill_(7.0) for _ in range(8)]
    assert torch.all(t == 3.0)
    del junk


@pytest.mark.parametrize("direct,engine", [(True, "auto"), (False, "auto"), (True, "sync")])
def test_round_trip(tmp_path, direct, engine):
    n = 3 * 262144 + 1024  # 3 MiB + 4 KiB of fp32: several blocks and a short last one
    a = strata.io.empty_aligned(n).uniform_()
    b = strata.io.empty_aligned(n).normal_()
    path = tmp_path / "data.bin"
    h = strata.io.AioHandle(block_size=1 << 20, queue_depth=8, threads=2, direct=direct, engine=engine)
    assert (h.block_size, h.queue_depth, h.threads, h.direct) == (1 << 20, 8, 2, direct)
    assert h.async_pwrite(a, path) == 4
    assert h.async_pwrite(b, str(path), offset=a.numel() * 4) == 4
    assert h.pending == 2
    assert h.wait() == 2
    assert os.path.getsize(path) == 2 * n * 4
    ra, rb = strata.io.empty_aligned(n), strata.io.empty_aligned(n)
    h.async_pread(rb, path, offset=n * 4)
    h.async_pread(ra, path)
    assert h.wait() == 2
    assert torch.equal(ra, a) and torch.equal(rb, b)
    # Sync variants return the bytes moved.
    c = strata.io.empty_aligned(1024)
    assert h.sync_pread(c, path, offset=4096) == 4096
    assert torch.equal(c, a[1024:2048])
    assert h.engine in ("io_uring", "sync")


def test_buffered_any_alignment(tmp_path):
    t = torch.arange(1000, dtype=torch.int32)[1:]  # not aligned, odd size
    h = strata.io.AioHandle(block_size=4096, direct=False)
    h.sync_pwrite(t, tmp_path / "x", offset=3)
    r = torch.zeros(999, dtype=torch.int32)
    h.sync_pread(r, tmp_path / "x", offset=3)
    assert torch.equal(r, t)


def test_tmpfs_with_direct(tmp_path):
    """/dev/shm (tmpfs) may refuse O_DIRECT: the handle falls back to buffered I/O."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    path = f"/dev/shm/strata-io-test-{os.getpid()}"
    try:
        a = strata.io.empty_aligned(4096).uniform_()
        r = strata.io.empty_aligned(4096)
        h = strata.io.AioHandle(block_size=8192, direct=True)
        h.sync_pwrite(a, path)
        h.sync_pread(r, path)
        assert torch.equal(a, r)
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_errors(tmp_path):
    h = strata.io.AioHandle(block_size=1 << 16, direct=True)
    # Missing directory: FileNotFoundError (an OSError) naming the path, with errno.
    with pytest.raises(OSError) as e:
        h.async_pwrite(strata.io.empty_aligned(1024), tmp_path / "missing" / "x")
    assert isinstance(e.value, FileNotFoundError) and e.value.errno == errno.ENOENT
    assert str(tmp_path / "missing" / "x") in str(e.value)
    # Misaligned with direct: ValueError saying what is misaligned.
    ok = strata.io.empty_aligned(2048)
    with pytest.raises(ValueError, match=r"direct=True needs .* aligned to 4096 bytes; misaligned: offset 100"):
        h.async_pwrite(ok, tmp_path / "y", offset=100)
    with pytest.raises(ValueError, match=r"misaligned: buffer address 0x[0-9a-f]+; length 4092 bytes"):
        h.async_pwrite(ok[1:1024], tmp_path / "y")
    assert h.pending == 0
    # Reading past the end of a file: OSError from the engine, after everything ended.
    h.sync_pwrite(ok, tmp_path / "short")
    big = strata.io.empty_aligned(1 << 16)
    h.async_pread(big, tmp_path / "short")
    with pytest.raises(OSError, match="end of file"):
        h.wait()
    assert h.pending == 0
    with pytest.raises(ValueError, match="not contiguous"):
        h.async_pwrite(torch.zeros(64, 64).t(), tmp_path / "z")
    with pytest.raises(TypeError):
        h.async_pwrite([1, 2, 3], tmp_path / "z")
    with pytest.raises(ValueError, match="engine"):
        strata.io.AioHandle(engine="bogus")
