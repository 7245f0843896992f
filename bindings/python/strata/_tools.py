"""The console scripts of the wheel: `strata-ckpt`, `strata-config` and `nvme_bench` start
the C++ tools installed in strata/bin (setup.py puts them there, with run paths to the
package's libraries and to torch's)."""

from __future__ import annotations

import os
import pathlib
import sys

BIN = pathlib.Path(__file__).resolve().parent / "bin"


def _exec(name: str) -> None:
    exe = BIN / name
    if not os.access(exe, os.X_OK):
        sys.stderr.write(
            f"{name}: {exe} is missing: this strata was not installed from its wheel (pip install "
            f"from the checkout puts the tools there); in a CMake build the tool is <build>/bin/{name}\n")
        raise SystemExit(127)
    os.execv(exe, [name, *sys.argv[1:]])


def strata_ckpt() -> None:
    _exec("strata-ckpt")


def strata_config() -> None:
    _exec("strata-config")


def nvme_bench() -> None:
    _exec("nvme_bench")
