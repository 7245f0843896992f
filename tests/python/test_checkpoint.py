"""engine.save_checkpoint / engine.load_checkpoint through `import strata`:
a run resumed from a checkpoint in a new process is bit-identical to an uninterrupted one
(losses, parameters, buffer, dropout and Python `random` draws, loss scale), for fp32, bf16
and fp16, 1 and 2 ranks, optimizer states in host memory and on NVMe; a checkpoint saved
on 2 ranks loads on 1; damaged and foreign checkpoints are refused with nothing changed."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ranks
from log_lines import LogLines
import strata

HERE = Path(__file__).resolve().parent
WORKER = HERE / "checkpoint_worker.py"


def run(tmp_path, world, seed, first, last, load="-", save="-", precision="fp32", offload="cpu", frozen="keep"):
    port = ranks.free_port()
    return ranks.run(
        tmp_path,
        WORKER,
        world,
        args_of=lambda r: [seed, first, last, load, save, precision, offload, frozen],
        env_of=lambda r: ranks.torchrun_env(r, world, port) if world > 1 else {},
    )


@pytest.mark.parametrize(
    "world,precision,offload",
    [(1, "fp32", "cpu"), (1, "bf16", "nvme"), (1, "fp16", "cpu"), (2, "fp32", "nvme"), (2, "bf16", "cpu"), (2, "fp16", "nvme")],
)
def test_resume_in_a_new_process_is_bit_identical(tmp_path, world, precision, offload):
    swap = tmp_path / "swap"
    swap.mkdir()
    off = str(swap) if offload == "nvme" else "cpu"
    ckpt = tmp_path / "ckpt"
    full = run(tmp_path, world, 5, 0, 4, precision=precision, offload=off)
    first = run(tmp_path, world, 5, 0, 2, save=ckpt, precision=precision, offload=off)
    assert first[0]["saved"] == str(ckpt / "global_step2")
    # The frozen `scale` in its own tensor, in the working dtype (format 2).
    manifest = json.loads((ckpt / "global_step2" / "manifest.json").read_text())
    frozen = [t for t in manifest["ranks"][0]["tensors"] if t["name"] == "frozen"]
    assert manifest["version"] == 2
    assert frozen[0]["dtype"] == {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}[precision]
    assert (ckpt / "latest").read_text().strip() == "global_step2"
    second = run(tmp_path, world, 9, 2, 4, load=ckpt, precision=precision, offload=off)
    for r in range(world):
        assert second[r]["path"] == str(ckpt / "global_step2")
        assert second[r]["client_state"] == {"position": 2, "rank": r, "t": [0, r, 2 * r]}
        assert second[r]["losses"] == full[r]["losses"][2:]
        assert second[r]["params"] == full[r]["params"]
        assert second[r]["running"] == full[r]["running"]
        assert second[r]["loss_scale"] == full[r]["loss_scale"]
        assert second[r]["lr"] == full[r]["lr"]
    if precision == "fp16":
        assert full[0]["loss_scale"] != 256.0  # the scale moved, so its state had to resume


def test_a_checkpoint_of_two_ranks_loads_on_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, 2, 5, 0, 2, save=ckpt)
    one = run(tmp_path, 1, 9, 2, 2, load=ckpt)[0]
    assert one["params"] == first[0]["params"]  # the consolidated master
    assert one["client_state"]["rank"] == 0
    manifest = json.loads((ckpt / "global_step2" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and manifest["version"] == 2  # 2: a frozen parameter


def _engine(seed=5):
    sys.path.insert(0, str(HERE))
    import checkpoint_worker as w

    model = w.Net(seed)
    engine, *_ = strata.initialize(model=model, config=w.config(1, "fp32", "cpu"))
    return engine, model, w


def _train(engine, w, steps):
    for _ in range(steps):
        x = torch.randint(0, w.VOCAB, (w.GLOBAL_BATCH, w.SEQ))
        loss = torch.nn.functional.cross_entropy(engine(x).reshape(-1, w.VOCAB), ((x * 3 + 1) % w.VOCAB).reshape(-1))
        engine.backward(loss)
        engine.step()


def test_damaged_or_foreign_checkpoints_are_refused_and_nothing_changes(tmp_path):
    engine, model, w = _engine()
    _train(engine, w, 1)
    path = engine.save_checkpoint(tmp_path, tag="t", client_state={"k": 1})
    assert path == str(tmp_path / "t")
    before = engine.gather_parameters()
    # A flipped bit in the master: DataLoss names the file, tensor and tag.
    rank_file = tmp_path / "t" / "rank-00000.bin"
    data = bytearray(rank_file.read_bytes())
    data[40] ^= 0x01
    rank_file.write_bytes(bytes(data))
    with pytest.raises(OSError) as err:
        engine.load_checkpoint(tmp_path)
    text = str(err.value)
    assert "rank-00000.bin" in text and "fp32_master" in text and "checkpoint t" in text and "CRC32C" in text, text
    assert "nothing was changed" in text
    for k, v in engine.gather_parameters().items():
        assert torch.equal(v, before[k]), k
    # Another model's checkpoint: the names are listed.
    other_model = w.Net(7)
    other_model.scale = torch.nn.Parameter(torch.ones(2 * w.DIM), requires_grad=False)
    other, *_ = strata.initialize(model=other_model, config=w.config(1, "fp32", "cpu"))
    other.save_checkpoint(tmp_path / "other")
    with pytest.raises(ValueError) as err:
        engine.load_checkpoint(tmp_path / "other")
    # The frozen scale is in the root's frozen group.
    assert "of another size (1): root:frozen/scale (checkpoint 32 elements, model 16)" in str(err.value), str(
        err.value
    )
    other.close()
    # No checkpoint at all: (None, None) and a warning, as DeepSpeed's (its
    # test_latest_checkpoint.py::test_missing_latest); FileNotFoundError with missing_ok=False.
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        engine.load_checkpoint(tmp_path / "empty", missing_ok=False)
    with LogLines() as log:
        assert engine.load_checkpoint(tmp_path / "empty") == (None, None)
    assert any("no 'latest' file there" in line for line in log.lines), log.lines
    # Between backward and step.
    x = torch.randint(0, w.VOCAB, (w.GLOBAL_BATCH, w.SEQ))
    engine.backward(engine(x).sum())
    with pytest.raises(RuntimeError, match="between backward"):
        engine.save_checkpoint(tmp_path)
    engine.step()
    engine.close()


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    """The saver process dies (_exit(9)) after its rank file is written and after the tag is
    renamed, before `latest` moves: `latest` still names the previous tag, which loads."""
    for point, tag_exists in (("rank_file_written", False), ("tag_renamed", True)):
        ckpt = tmp_path / point
        run(tmp_path, 1, 5, 0, 1, save=ckpt)
        env = {k: v for k, v in os.environ.items() if k not in ranks.TORCHRUN_VARS}
        env.update(OMP_NUM_THREADS="1", STRATA_TEST_CHECKPOINT_CRASH_AT=point,
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.run(
            [sys.executable, str(WORKER), str(tmp_path / "x.json"), "5", "1", "2", str(ckpt), str(ckpt), "fp32", "cpu"],
            env=env, capture_output=True, text=True, timeout=300,
        )
        assert proc.returncode == 9, proc.stdout + proc.stderr
        assert (ckpt / "latest").read_text().strip() == "global_step1"
        assert (ckpt / "global_step2").exists() == tag_exists
        if tag_exists:
            assert (ckpt / "global_step2" / "manifest.json").exists()
        resumed = run(tmp_path, 1, 9, 1, 2, load=ckpt)[0]
        assert resumed["path"] == str(ckpt / "global_step1")


CKPT_TOOL = Path(os.environ.get("STRATA_BUILD_DIR", HERE.parents[1] / "build")).resolve() / "bin" / "strata-ckpt"


def _tool(*args):
    return subprocess.run([str(CKPT_TOOL), *map(str, args)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_strata_ckpt_exports_the_model_as_safetensors(tmp_path, dtype):
    """strata-ckpt export of a 2-rank checkpoint, read back with the `safetensors` package:
    the model's parameters (trained, consolidated from both ranks, and frozen) by name,
    shape and value; info and verify report it; a flipped bit fails verify."""
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    first = run(tmp_path, 2, 5, 0, 2, save=ckpt)[0]
    out = tmp_path / "model.safetensors"
    proc = _tool("export", ckpt, "--safetensors", out, "--dtype", dtype)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "peak memory" in proc.stdout
    got = load_file(str(out))
    sys.path.insert(0, str(HERE))
    import checkpoint_worker as w

    model = w.Net(5)  # the frozen `scale` is the initial one
    want_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    names = [n for n, _ in model.named_parameters()]
    assert sorted(got) == sorted(names)
    for name, p in model.named_parameters():
        value = p.detach() if not p.requires_grad else torch.tensor(first["params"][name])
        assert got[name].dtype == want_dtype, name
        assert got[name].shape == p.shape, name
        assert torch.equal(got[name], value.to(want_dtype)), name
    info = _tool("info", ckpt)
    assert info.returncode == 0 and "world size       2" in info.stdout and "<- latest" in info.stdout, info.stdout
    assert "frozen values    F32, the working dtype" in info.stdout, info.stdout
    ok = _tool("verify", ckpt)
    assert ok.returncode == 0 and re.search(r" (\d+) of \1 tensors ok", ok.stdout), ok.stdout
    rank1 = ckpt / "global_step2" / "rank-00001.bin"
    data = bytearray(rank1.read_bytes())
    data[10] ^= 0x04
    rank1.write_bytes(bytes(data))
    bad = _tool("verify", ckpt)
    assert bad.returncode == 1 and "BAD" in bad.stdout and "rank-00001.bin" in bad.stdout, bad.stdout
    failed = _tool("export", ckpt, "--safetensors", tmp_path / "again.safetensors")
    assert failed.returncode == 1 and "CRC32C" in failed.stderr, failed.stderr
    assert not (tmp_path / "again.safetensors").exists() and not (tmp_path / "again.safetensors.tmp").exists()
    assert _tool("export", ckpt).returncode == 2
    assert _tool("bogus", ckpt).returncode == 2


def test_a_checkpoint_without_its_frozen_parameters_resumes_on_the_same_base(tmp_path):
    """save_checkpoint(exclude_frozen_parameters=True): the frozen `scale` is not in the
    files (format 2, fp32_master as long as exp_avg); a run that builds the model with the
    same base resumes it bit for bit on 2 ranks; one built with another base is refused
    (the manifest's fingerprint of the base), nothing changed, and with
    check_frozen_parameters=False keeps its own frozen values (not the saved run's);
    strata-ckpt info says so and export leaves it out."""
    from safetensors.torch import load_file

    ckpt = tmp_path / "ckpt"
    full = run(tmp_path, 2, 5, 0, 4)
    run(tmp_path, 2, 5, 0, 2, save=ckpt, frozen="exclude")
    manifest = json.loads((ckpt / "global_step2" / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["frozen_parameters_saved"] is False
    assert [g["name"] for g in manifest["groups"] if g.get("frozen")] == ["root:frozen"]
    assert [len(g["frozen_fingerprint"]) for g in manifest["groups"] if g.get("frozen")] == [16]
    assert all("frozen_fingerprint_partials" not in part for part in manifest["ranks"])
    for part in manifest["ranks"]:
        numel = {t["name"]: t["shape"] for t in part["tensors"]}
        assert numel["fp32_master"] == numel["exp_avg"], numel
    same = run(tmp_path, 2, 5, 2, 4, load=ckpt)
    for r in range(2):
        assert same[r]["losses"] == full[r]["losses"][2:]
        assert same[r]["params"] == full[r]["params"]
    sys.path.insert(0, str(HERE))
    import checkpoint_worker as w

    refused = run(tmp_path, 1, 9, 2, 3, load=ckpt, frozen="try")[0]
    assert "not the base it was trained on" in refused["load_error"], refused["load_error"]
    assert "differ: root:frozen)" in refused["load_error"] and "nothing was changed" in refused["load_error"]
    assert refused["params"] == {k: v.tolist() for k, v in w.Net(9).named_parameters()}
    other = run(tmp_path, 1, 9, 2, 3, load=ckpt, frozen="unchecked")[0]
    assert other["params"]["scale"] == w.Net(9).scale.tolist()
    assert other["params"]["scale"] != full[0]["params"]["scale"]
    info = _tool("info", ckpt)
    assert info.returncode == 0 and "frozen values    not saved" in info.stdout, info.stdout
    assert "checks it against the fingerprints of 1 of 1 frozen groups" in info.stdout, info.stdout
    # strata-ckpt check-base: the saving run's base (a whole model's file), another, and one
    # without the frozen parameter.
    from safetensors.torch import save_file

    for seed, tensors, code, words in (
        (5, None, 0, ["root:frozen", "matches", "the base matches all 1 frozen groups"]),
        (9, None, 1, ["DIFFERS", "1 of 1 frozen groups differ: this is not the base"]),
        (5, ["head.weight"], 1, ["CANNOT CHECK", "scale is not in the base", "1 of 1 frozen groups cannot be checked"]),
    ):
        base = tmp_path / f"base-{seed}-{len(tensors or [])}.safetensors"
        params = {n: p.detach().contiguous() for n, p in w.Net(seed).named_parameters()}
        save_file({n: t for n, t in params.items() if tensors is None or n in tensors}, str(base))
        proc = _tool("check-base", ckpt, "--safetensors", base)
        assert proc.returncode == code, proc.stdout + proc.stderr
        for word in words:
            assert word in proc.stdout, proc.stdout
    out = tmp_path / "adapters.safetensors"
    proc = _tool("export", ckpt, "--safetensors", out)
    assert proc.returncode == 0 and "left out 1 frozen parameters" in proc.stdout, proc.stdout + proc.stderr
    got = load_file(str(out))
    assert "scale" not in got and "head.weight" in got
    assert sorted(got) == sorted(n for n, p in w.Net(5).named_parameters() if p.requires_grad)


def test_a_checkpoint_of_an_earlier_build_resumes(tmp_path):
    """A checkpoint written by an earlier build still loads: tests/fixtures/checkpoints/python
    was written by the Python front end as it was before the hook protocol moved into the
    engine, by this test with STRATA_WRITE_CHECKPOINT_FIXTURE=<dir>
    (tests/fixtures/checkpoints/make.sh): the worker's model trained 2 steps on 2 ranks and
    saved, beside expected.json with each rank's parameters at the save and the uninterrupted
    run's losses at steps 2 and 3 and parameters after them. Resumed from another seed: the
    parameters exactly, the client state, and the next two steps (dropout and `random` from
    the restored generators) as the uninterrupted run's (to 1e-5: another machine's CPU
    kernels may round differently)."""
    write = os.environ.get("STRATA_WRITE_CHECKPOINT_FIXTURE")
    fixture = Path(write) if write else HERE.parent / "fixtures" / "checkpoints" / "python"
    if write:
        full = run(tmp_path, 2, 5, 0, 4)
        first = run(tmp_path, 2, 5, 0, 2, save=fixture / "ckpt")
        expected = {
            "params_at_save": [r["params"] for r in first],
            "losses": [r["losses"][2:] for r in full],
            "params_after": [r["params"] for r in full],
        }
        (fixture / "expected.json").write_text(json.dumps(expected) + "\n")
        return
    expected = json.loads((fixture / "expected.json").read_text())
    at_load = run(tmp_path, 2, 9, 2, 2, load=fixture / "ckpt")
    resumed = run(tmp_path, 2, 9, 2, 4, load=fixture / "ckpt")
    for r in range(2):
        assert at_load[r]["client_state"] == {"position": 2, "rank": r, "t": [0, r, 2 * r]}
        assert at_load[r]["params"] == expected["params_at_save"][r]
        assert resumed[r]["losses"] == pytest.approx(expected["losses"][r], rel=1e-5)
        for name, value in expected["params_after"][r].items():
            got = torch.tensor(resumed[r]["params"][name])
            torch.testing.assert_close(got, torch.tensor(value), rtol=1e-5, atol=1e-6, msg=name)
