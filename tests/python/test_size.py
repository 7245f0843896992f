"""Size limits of the library, binding and tool sources, so that they stop slipping.

No source file over MAX_FILE_LINES lines (its physical lines, as `wc -l` counts them) and no
function over MAX_FUNCTION_LINES lines, the functions found and measured by lizard (pinned in
requirements.txt): a function's lines are lizard's `length`, from the line its name is on to
the line its body ends on (end_line - start_line + 1), comments and blank lines included.

Checked: the C++ (.h .hpp .cc .cpp .cu .cuh) and Python sources of the library (core, comm,
swap, offload, optim, engine), the bindings, the tools and the examples. Not tests/ or bench/.
A justified exception is listed in EXCEPTIONS with its reason; an exception that is no longer
needed fails too, so the list stays short.
"""

import functools
import os
import pathlib

import pytest

try:
    import lizard
except ImportError:  # pragma: no cover - the venv has it (requirements.txt)
    lizard = None

REPO = pathlib.Path(__file__).resolve().parents[2]

MAX_FILE_LINES = 1000
MAX_FUNCTION_LINES = 150

FOLDERS = ("core", "comm", "swap", "offload", "optim", "engine", "bindings", "tools", "examples")
CPP_EXT = {".h", ".hpp", ".cc", ".cpp", ".cu", ".cuh"}
PY_EXT = {".py"}
SKIP_DIRS = {"build", "__pycache__", ".venv"}

# Justified exceptions: a file ("core/config_keys.cc") or a function ("path::name", the name
# as lizard reports it, with its namespaces and class: "core/planner.cc::strata::MakePlan")
# -> why it may be longer.
EXCEPTIONS: dict[str, str] = {}


def sources():
    found = []
    for folder in FOLDERS:
        for dirpath, dirnames, filenames in os.walk(REPO / folder):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
            for name in filenames:
                p = pathlib.Path(dirpath) / name
                if p.suffix in CPP_EXT | PY_EXT:
                    found.append(p)
    return sorted(found)


def rel(p: pathlib.Path) -> str:
    return p.relative_to(REPO).as_posix()


def functions(p: pathlib.Path):
    """lizard's functions of source file `p` (C++ for the CUDA suffixes too)."""
    text = p.read_text(encoding="utf-8")
    # lizard picks its reader by the suffix and reads a suffix it does not know (.cu, .cuh)
    # as C++; the name it is given only chooses the reader.
    name = str(p) if p.suffix in PY_EXT | {".h", ".hpp", ".cc", ".cpp"} else str(p) + ".cc"
    return lizard.analyze_file.analyze_source_code(name, text).function_list


@pytest.fixture(scope="module", autouse=True)
def need_lizard():
    if lizard is None:
        pytest.fail("the size test needs lizard (requirements.txt: scripts/setup.sh installs it)")


@functools.cache
def file_offenders():
    out = {}
    for p in sources():
        with p.open("rb") as f:
            n = sum(1 for _ in f)
        if n > MAX_FILE_LINES:
            out[rel(p)] = n
    return out


@functools.cache
def function_offenders():
    out = {}
    for p in sources():
        for fn in functions(p):
            if fn.length > MAX_FUNCTION_LINES:
                out[f"{rel(p)}::{fn.name}"] = (fn.start_line, fn.length)
    return out


def test_sources_found():
    paths = {rel(p) for p in sources()}
    assert "core/config.cc" in paths and "bindings/python/strata/engine.py" in paths, (
        "the size test found none of the sources it checks")


def test_lizard_reads_cpp_and_python(tmp_path):
    """The measure itself: lizard finds C++ (also under a CUDA suffix) and Python functions and
    counts their lines from the name to the closing line."""
    cpp = "namespace n {\n\n// doc\nint A::F(int x) {\n  if (x) {\n    return 1;\n  }\n\n  return 0;\n}\n}\n"
    py = "def f(x):\n    # doc\n    if x:\n        return 1\n\n    return 0\n\n\nclass C:\n    def g(self):\n        pass\n"
    for suffix in (".cc", ".h", ".cu", ".cuh"):
        p = tmp_path / f"a{suffix}"
        p.write_text(cpp)
        fns = functions(p)
        assert [(f.name, f.start_line, f.length) for f in fns] == [("n::A::F", 4, 7)], suffix
    p = tmp_path / "a.py"
    p.write_text(py)
    assert [(f.name, f.start_line, f.length) for f in functions(p)] == [("f", 1, 6), ("g", 10, 2)]


def offenders_message(what: str, rows: list[str], advice: str) -> str:
    return (f"{len(rows)} {what}; {advice} (or, if justified, list it in EXCEPTIONS in "
            "tests/python/test_size.py with the reason):\n" + "\n".join(rows))


def test_no_file_over_the_limit():
    bad = {k: n for k, n in file_offenders().items() if k not in EXCEPTIONS}
    rows = [f"  {k}: {n} lines" for k, n in sorted(bad.items(), key=lambda kv: -kv[1])]
    assert not bad, offenders_message(f"source file(s) over {MAX_FILE_LINES} lines", rows,
                                      "split each by responsibility")


def test_no_function_over_the_limit():
    bad = {k: v for k, v in function_offenders().items() if k not in EXCEPTIONS}
    rows = [f"  {k.split('::', 1)[0]}:{line} {k.split('::', 1)[1]}: {n} lines"
            for k, (line, n) in sorted(bad.items(), key=lambda kv: -kv[1][1])]
    assert not bad, offenders_message(
        f"function(s) over {MAX_FUNCTION_LINES} lines (lizard's length: from the name's line "
        "to the closing line)", rows, "split each into named steps")


def test_exceptions_are_still_needed():
    over = set(file_offenders()) | set(function_offenders())
    stale = sorted(set(EXCEPTIONS) - over)
    assert not stale, ("EXCEPTIONS in tests/python/test_size.py lists sources within the limits "
                       "now; remove them:\n" + "\n".join(f"  {k}" for k in stale))
