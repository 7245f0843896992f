"""Builds the `strata` Python package with CMake (see pyproject.toml and docs/python.md).

`pip install --no-build-isolation .` runs this from the checkout. It configures (once) and
builds the CMake target _strata, then puts into the wheel: the pure-Python modules of
bindings/python/strata, the extension, and the Strata shared libraries the extension
needs (copied next to it, with their run path set to $ORIGIN, so the installed package
does not depend on the build directory).

Environment:
  STRATA_BUILD_DIR   an existing, configured CMake build directory to build in (e.g. the
                     one of the tests); default <checkout>/build-pip/cmake, configured
                     here (RelWithDebInfo, as the project is tested; Ninja when available).
  STRATA_CMAKE_ARGS  extra arguments for the configure step.
  CMAKE_BUILD_PARALLEL_LEVEL  build jobs (default: the number of CPUs).
  STRATA_KEEP_DEBUG_INFO  set: do not strip debug information from the copied libraries.
"""

import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent
PIP_DIR = ROOT / "build-pip"


def version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\(\s*Strata\s+VERSION\s+([0-9.]+)", text)
    return m.group(1) if m else "0.0.0"


def run(cmd, **kw):
    print("strata setup.py:", " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def set_runpath(files):
    """Sets the ELF run path of `files` to $ORIGIN (CMake's file(RPATH_SET))."""
    script = PIP_DIR / "set_runpath.cmake"
    lines = [f'file(RPATH_SET FILE "{f}" NEW_RPATH "$ORIGIN")' for f in files]
    script.write_text("\n".join(lines) + "\n")
    run(["cmake", "-P", script])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.environ.get("STRATA_BUILD_DIR")
        if build_dir and (pathlib.Path(build_dir) / "CMakeCache.txt").exists():
            build = pathlib.Path(build_dir).resolve()
        else:
            build = (PIP_DIR / "cmake").resolve()
            if not (build / "CMakeCache.txt").exists():
                cmd = ["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
                       f"-DSTRATA_PYTHON_EXECUTABLE={sys.executable}"]
                if shutil.which("ninja"):
                    cmd += ["-G", "Ninja"]
                cmd += shlex.split(os.environ.get("STRATA_CMAKE_ARGS", ""))
                run(cmd)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        run(["cmake", "--build", build, "--target", "_strata", "-j", jobs])

        pkg = build / "python" / "strata"
        built = sorted(pkg.glob("_strata*.so"))
        if not built:
            raise RuntimeError(f"strata setup.py: no _strata*.so in {pkg} after the build")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)
        # The Strata shared libraries the extension loads from the build tree.
        out = subprocess.run(["ldd", str(built[0])], check=True, capture_output=True, text=True).stdout
        copied = [target]
        for line in out.splitlines():
            m = re.match(r"\s*(\S+) => (\S+)", line)
            if m and pathlib.Path(m.group(2)).resolve().is_relative_to(build):
                dest = target.parent / m.group(1)
                shutil.copyfile(pathlib.Path(m.group(2)).resolve(), dest)
                copied.append(dest)
        set_runpath(copied)
        if shutil.which("strip") and not os.environ.get("STRATA_KEEP_DEBUG_INFO"):
            run(["strip", "--strip-debug", *copied])


PIP_DIR.mkdir(exist_ok=True)
setup(
    version=version(),
    packages=["strata", "strata.integrations"],
    package_dir={"strata": "bindings/python/strata"},
    ext_modules=[Extension("strata._strata", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    options={
        "build": {"build_base": str(PIP_DIR / "setuptools")},
        "egg_info": {"egg_base": str(PIP_DIR)},
    },
)
