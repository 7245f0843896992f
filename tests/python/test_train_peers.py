"""bench/peers/train_peers.py runs (a smoke test of the program, not a measurement): the
tiny preset through Strata, FSDP2 (gloo, CPU) and unsharded torch on 1 and 2 torchrun
ranks, results in its JSON, and argument errors. DeepSpeed is left out (bench/peers brings
it, not the test set-up)."""

import json
import pathlib
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_script  # noqa: E402


def run(args, tmp_path):
    return bench_script.run("peers/train_peers.py", args, tmp_path, timeout=600)


def test_strata_fsdp2_and_torch_on_one_and_two_ranks(tmp_path):
    out = tmp_path / "r.json"
    p = run(["--model", "tiny", "--batch", "2", "--ranks", "1,2", "--repeats", "1", "--steps", "2", "--warmup",
             "1", "--peers", "strata,fsdp2,torch", "--threads", "1", "--json", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = {(r["ranks"], r["peer"]): r for r in json.loads(out.read_text())["rows"]}
    # torch (unsharded) runs on 1 rank only.
    assert set(rows) == {(1, "strata"), (1, "fsdp2"), (1, "torch"), (2, "strata"), (2, "fsdp2")}
    for r in rows.values():
        assert "error" not in r, r
        assert r["step_s"] > 0 and set(r["phases_s"]) == {"forward", "backward", "step"}
        assert r["rss_peak"] > r["rss_after_imports"] > 0
    # Same initial values and tokens: every peer's first loss agrees (bf16, computed
    # differently), on 1 and on 2 ranks.
    for ranks in (1, 2):
        first = [r["loss_first"] for (k, _), r in rows.items() if k == ranks]
        assert max(first) - min(first) < 1e-2, first
    assert "vs strata" in p.stdout


def test_bad_arguments_are_refused(tmp_path):
    p = run(["--peers", "strata,megatron"], tmp_path)
    assert p.returncode == 2 and "unknown peer megatron" in p.stderr
    p = run(["--model", "huge"], tmp_path)
    assert p.returncode == 2 and "invalid choice" in p.stderr
    p = run(["--ranks", "0"], tmp_path)
    assert p.returncode == 2 and "at least 1" in p.stderr
