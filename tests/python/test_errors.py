"""C++ Status errors arrive as Python exceptions with the same message."""

import errno

import pytest

strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

MAPPING = [
    ("InvalidArgument", ValueError),
    ("OutOfRange", ValueError),
    ("NotFound", FileNotFoundError),
    ("PermissionDenied", PermissionError),
    ("AlreadyExists", FileExistsError),
    ("IOError", OSError),
    ("DataLoss", OSError),
    ("Unimplemented", NotImplementedError),
    ("FailedPrecondition", RuntimeError),
    ("Unavailable", RuntimeError),
    ("DeadlineExceeded", RuntimeError),
    ("Cancelled", RuntimeError),
    ("Internal", RuntimeError),
    ("ResourceExhausted", RuntimeError),
]


@pytest.mark.parametrize("code,exc", MAPPING)
def test_status_codes_map_to_exceptions(code, exc):
    with pytest.raises(exc) as e:
        strata._strata._raise_status(code, f"the message of {code}")
    assert str(e.value) == f"the message of {code}"
    assert e.value.status_code == code
    if exc in (ValueError, RuntimeError):
        assert not isinstance(e.value, OSError)


def test_errno_kept_and_disk_full_is_oserror():
    with pytest.raises(OSError) as e:
        strata._strata._raise_status("ResourceExhausted", "pwrite: No space left on device", errno.ENOSPC)
    assert e.value.errno == errno.ENOSPC
    assert str(e.value) == "pwrite: No space left on device"
    with pytest.raises(OSError) as e:
        strata._strata._raise_status("IOError", "pread: Input/output error", errno.EIO)
    assert e.value.errno == errno.EIO


def test_real_errors():
    with pytest.raises(ValueError, match="unknown unit"):
        strata.parse_bytes("12XB")
    with pytest.raises(ValueError, match="block_size 1000 is not a positive multiple of 4096"):
        strata.io.AioHandle(block_size=1000)
