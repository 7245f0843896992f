"""`pip install --no-build-isolation .` into a fresh venv that sees the project venv's torch
(a .pth file), then `import strata` from outside the source tree (docs/python.md,
"Install")."""

import importlib.util
import os
import pathlib
import subprocess
import sys

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
