"""The layer rules of docs/architecture.md ("Layers", "engine/ by concept"), checked on the sources.

Each folder may include headers only of the layers it may use; LibTorch only in
engine/libtorch/ (the LibTorch front end), bindings/, examples/, bench/ and comm's
rendezvous unit; no assert() for run-time errors in library code.
"""

import os
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

# What the engine may use below it (docs/architecture.md, "Layers").
BELOW_ENGINE = {"core", "core/cuda", "offload/cpu", "swap", "offload/nvme", "optim/cpu_adam", "comm"}
# folder -> strata folders it may include (its own included).
ALLOWED = {
    "core": {"core"},
    "core/cuda": {"core", "core/cuda"},
    "offload/cpu": {"core", "core/cuda", "offload/cpu"},
    "swap": {"core", "core/cuda", "offload/cpu", "swap"},
    "offload/nvme": {"core", "core/cuda", "offload/cpu", "swap", "offload/nvme"},
    "optim/cpu_adam": {"core", "optim/cpu_adam"},
    "comm": {"core", "core/cuda", "comm"},
    # The planner measures CPU-Adam's rate on the spot (docs/architecture.md).
    "tools/strata-config": {"core", "optim/cpu_adam", "tools/strata-config"},
    "tools/nvme_bench": {"core", "core/cuda", "offload/cpu", "swap", "tools/nvme_bench"},
    # The engine's sub-folders (engine/README.md), each over the layers below the engine and
    # the sub-folders listed; LibTorch in engine/libtorch only (test_libtorch_only_where_allowed).
    **{f"engine/{sub}": BELOW_ENGINE | {f"engine/{u}" for u in uses | {sub}} for sub, uses in {
        "layout": set(),
        "device": {"layout"},
        "timeline": set(),
        "agreement": set(),
        "gather": {"layout", "device", "timeline"},
        "reduce": {"layout", "device", "timeline"},
        "step": {"layout", "device", "timeline", "agreement", "gather"},
        "checkpoint": {"layout", "agreement"},
        "runtime": {"layout", "device", "timeline", "agreement", "gather", "reduce", "step", "checkpoint"},
        "protocol": {"layout", "device", "timeline", "gather", "reduce", "step", "checkpoint", "runtime"},
        # agreement: the front end's own local checks agreed on (engine_core.h's host_comm).
        "libtorch": {"layout", "device", "timeline", "agreement", "gather", "reduce", "step", "checkpoint",
                     "runtime", "protocol"},
    }.items()},
    # Reads checkpoints through the engine's torch-free checkpoint code (engine/checkpoint/).
    "tools/strata-ckpt": {"core", "engine/checkpoint", "engine/layout", "tools/strata-ckpt"},
}
TORCH_OK = ("engine/libtorch/", "bindings/", "examples/", "bench/", "tests/")
SOURCE_EXT = {".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh"}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)
FOLDERS = sorted(ALLOWED, key=len, reverse=True)
# The folders with a CMakeLists.txt of their own (the engine's sub-folders share engine/'s).
CMAKE_FOLDERS = sorted(f for f in ALLOWED if (REPO / f / "CMakeLists.txt").exists())


def folder_of(path: pathlib.Path) -> str | None:
    rel = path.relative_to(REPO).as_posix()
    for f in FOLDERS:
        if rel.startswith(f + "/") and "/" not in rel[len(f) + 1 :]:
            return f
    return None


def target_folder(include: str) -> str | None:
    if not include.startswith("strata/"):
        return None
    rest = include[len("strata/") :]
    for f in FOLDERS:
        if rest.startswith(f + "/") and "/" not in rest[len(f) + 1 :]:
            return f
    return rest.rsplit("/", 1)[0]


SKIP_DIRS = ("build", ".git", ".venv", ".whl", "tests/install/consumer")


def sources():
    found = []
    for dirpath, dirnames, filenames in os.walk(REPO):
        rel_dir = pathlib.Path(dirpath).relative_to(REPO).as_posix()
        dirnames[:] = [
            d for d in dirnames
            if not (d if rel_dir == "." else f"{rel_dir}/{d}").startswith(SKIP_DIRS)
        ]
        for name in filenames:
            p = pathlib.Path(dirpath) / name
            if p.suffix in SOURCE_EXT:
                found.append(p)
    yield from sorted(found)


def test_sources_found():
    assert any(folder_of(p) == "core" for p in sources()), "no core sources found"


def test_layers_include_only_what_they_may_use():
    bad = []
    for p in sources():
        f = folder_of(p)
        if f is None:
            continue
        for inc in INCLUDE.findall(p.read_text(errors="replace")):
            t = target_folder(inc)
            if t is not None and t not in ALLOWED[f]:
                bad.append(f"{p.relative_to(REPO)} includes {inc} ({f} may not use {t})")
    assert not bad, "\n".join(bad)


def test_libtorch_only_where_allowed():
    bad = []
    for p in sources():
        rel = p.relative_to(REPO).as_posix()
        if rel.startswith(TORCH_OK) or (rel.startswith("comm/") and "rendezvous" in rel):
            continue
        for inc in INCLUDE.findall(p.read_text(errors="replace")):
            if inc.startswith(("torch/", "ATen/", "c10/")):
                bad.append(f"{rel} includes {inc}")
    assert not bad, "LibTorch outside engine/libtorch/, bindings, examples, bench and tests:\n" + "\n".join(bad)


def test_no_gloo_library_in_strata():
    """One Gloo per process (docs/comm.md): torch carries its own inside libtorch_cpu, so no
    Strata source includes Gloo's headers (the gloo backend has its own TCP transport)."""
    bad = []
    for p in sources():
        for inc in INCLUDE.findall(p.read_text(errors="replace")):
            if inc.startswith("gloo/"):
                bad.append(f"{p.relative_to(REPO)} includes {inc}")
    assert not bad, "\n".join(bad)


def test_no_assert_for_runtime_errors():
    pattern = re.compile(r"(^|[^_A-Za-z])assert\(")
    bad = []
    for p in sources():
        rel = p.relative_to(REPO).as_posix()
        if not rel.startswith(("core", "swap", "offload", "optim", "comm", "engine", "tools")):
            continue
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            code = line.split("//", 1)[0]
            if pattern.search(code) and "static_assert" not in code:
                bad.append(f"{rel}:{n}: {line.strip()}")
    assert not bad, "assert() in library code (use Status or STRATA_CHECK):\n" + "\n".join(bad)


@pytest.mark.parametrize("folder", CMAKE_FOLDERS)
def test_cmake_links_follow_the_layers(folder):
    """A folder's CMakeLists.txt links no Strata library of a layer above it."""
    cml = REPO / folder / "CMakeLists.txt"
    if not cml.exists():
        pytest.skip(f"{folder} has no CMakeLists.txt")
    text = cml.read_text()
    names = {
        "strata_core": {"core"}, "strata_cuda": {"core/cuda"}, "strata_offload_cpu": {"offload/cpu"},
        "strata_swap": {"swap"}, "strata_offload_nvme": {"offload/nvme"},
        "strata_cpu_adam": {"optim/cpu_adam"}, "strata_comm": {"comm"},
        "strata_engine": {"engine/libtorch"},
        # The engine's torch-free sub-folders are one library.
        "strata_engine_core": {f for f in ALLOWED if f.startswith("engine/")} | {"engine/checkpoint"},
    }
    linked = set(re.findall(r"\b(strata_[a-z_]+)\b", text))
    own = {n for n, fs in names.items() if folder in fs}
    bad = [n for n in linked & names.keys() - own if not names[n] & ALLOWED[folder]]
    assert not bad, f"{folder}/CMakeLists.txt links {bad}"
