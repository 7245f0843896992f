"""One Gloo per process (docs/comm.md, "One Gloo, one NCCL per process").

Two ranks, each one process that runs torch.distributed's Gloo collectives and Strata's
collectives (a ZeRO-3 engine on the same store), results checked; then, from each rank's
/proc/self/maps, exactly one mapped file defines Gloo (torch's libtorch_cpu.so), one CUDA
runtime and at most one NCCL are mapped; and no Strata library exports a Gloo symbol.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ranks  # noqa: E402
import toy_model  # noqa: E402

STEPS, GLOBAL_BATCH = 4, 8


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if shutil.which("nm") is None:
        pytest.fail("nm (binutils) is needed to read the mapped libraries' symbols")
    port = ranks.free_port()
    return ranks.run(tmp_path_factory.mktemp("one_gloo"), HERE / "one_gloo_worker.py", 2, lambda r: [r, 2, port])


def test_both_libraries_collectives_are_right(results):
    ref_losses, ref_model = toy_model.reference_losses(STEPS, GLOBAL_BATCH)
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / 2
        assert abs(mean - ref_losses[step]) <= 1e-5 * abs(ref_losses[step]), step
    for name, p in ref_model.named_parameters():
        for r in results:
            torch.testing.assert_close(torch.tensor(r["params"][name]), p.detach(), rtol=1e-4, atol=1e-5, msg=name)
    for r in results:
        assert r["comm"]["bytes_sent"] > 0 and r["comm"]["operations"] > 0, r["comm"]


def test_exactly_one_gloo_is_mapped(results):
    """torch's one Gloo lives in torch's own libraries (libtorch_cpu, and in a CUDA build
    libtorch_cuda, which links some of the same Gloo objects again: one source, one
    version); no other mapped file defines a Gloo symbol."""
    torch_lib = pathlib.Path(torch.__file__).resolve().parent / "lib"
    for r in results:
        assert r["gloo_named"] == [], f"a Gloo library is mapped: {r['gloo_named']}"
        files = r["gloo_files"]
        assert any(os.path.basename(f).startswith("libtorch_cpu.so") for f in files), files
        outside = [f for f in files if pathlib.Path(f).resolve().parent != torch_lib]
        assert not outside, f"Gloo symbols defined outside torch's libraries: {outside}"
        assert r["strata_libs"], "no Strata library mapped: the test did not load Strata"


def test_one_cuda_runtime_and_one_nccl(results):
    for r in results:
        # A CUDA build of torch maps its CUDA runtime and NCCL even without a GPU.
        if torch.version.cuda is not None:
            assert len(r["cudart"]) == 1, r["cudart"]
            assert len(r["nccl"]) == 1, r["nccl"]
            torch_dir = pathlib.Path(torch.__file__).resolve().parent
            wheel = torch_dir.parent / "nvidia"
            if wheel.is_dir():
                # The wheel's own copies, which Strata links too (CMakeLists.txt).
                assert r["cudart"][0].startswith(str(wheel)), r["cudart"]
                assert r["nccl"][0].startswith(str(wheel)), r["nccl"]
        else:
            assert len(r["cudart"]) <= 1 and len(r["nccl"]) <= 1


def strata_libraries():
    """Every Strata shared library of the build (and the Python module), symlinks left out."""
    build = pathlib.Path(os.environ.get("STRATA_BUILD_DIR", HERE.parents[1] / "build"))
    libs = sorted((build / "lib").glob("libstrata_*.so*")) + sorted((build / "python").rglob("_strata*.so"))
    libs = [p for p in libs if not p.is_symlink()]
    assert libs, f"no Strata library under {build}"
    return libs


def test_no_strata_library_exports_gloo():
    libs = strata_libraries()
    bad = []
    for lib in libs:
        r = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
        if re.search(r" [A-Za-z] _ZN(K)?4gloo", r.stdout):
            bad.append(str(lib))
        r = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True)
        if "gloo" in r.stdout.lower():
            bad.append(f"{lib} needs a Gloo library")
    assert not bad, bad


def test_every_strata_library_uses_the_shared_cxx_runtime():
    """One C++ runtime per process: no Strata library defines libstdc++'s code (each uses
    libstdc++.so, the one torch's process loads). A compiler that links libstdc++ statically
    into shared objects (the GPU image's /opt/gcc) gave a library its own copy, and the
    Python engine crashed in its first std::ostream call beside torch's copy. A library
    that calls nothing of libstdc++ may not need it at all (libstrata_cuda.so, linked with
    --as-needed on the GPU image); the libraries written in C++ throughout must."""
    libs = strata_libraries()
    bad = []
    # Defined only in libstdc++ itself: std::ostream::_M_insert<long> (every operator<< of
    # an integer), std::locale's and std::ios_base::Init's constructors.
    own_runtime = re.compile(r" [TtWw] (_ZNSo9_M_insertIlEERSoT_|_ZNSt6localeC[12]Ev|_ZNSt8ios_base4InitC[12]Ev)(@\S*)?$", re.M)
    for lib in libs:
        r = subprocess.run(["nm", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
        m = own_runtime.search(r.stdout)
        if m:
            bad.append(f"{lib} defines libstdc++'s {m.group(1)} (a static copy of the C++ runtime)")
        r = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True)
        if "libstrata_cuda" not in lib.name and not re.search(r"NEEDED.*\[libstdc\+\+\.so", r.stdout):
            bad.append(f"{lib} does not need libstdc++.so")
    assert not bad, bad
