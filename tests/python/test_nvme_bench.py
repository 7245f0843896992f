"""strata.nvme_bench: a quick sweep through tools/nvme_bench's library."""

import pytest

strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

KEYS = {"mode", "block_size", "queue_depth", "threads", "memory", "gbps", "iops", "p50_us", "p99_us"}


def test_quick_sweep(tmp_path):
    r = strata.nvme_bench(path=tmp_path, quick=True, size="8MiB", seconds=0.05, memory="plain", direct=False)
    # --quick: blocks 128K and 1M, queue depths 4 and 16, one thread, read and write.
    assert len(r["points"]) == 8
    for p in r["points"]:
        assert KEYS <= set(p), p
        assert p["memory"] == "plain" and p["threads"] == 1
        assert p["gbps"] > 0 and p["iops"] > 0 and p["p99_us"] >= p["p50_us"] > 0
    assert {p["mode"] for p in r["points"]} == {"read", "write"}
    assert {p["block_size"] for p in r["points"]} == {128 << 10, 1 << 20}
    assert r["best_read"]["mode"] == "read" and r["best_write"]["mode"] == "write"
    aio = r["config"]["aio"]
    assert set(aio) == {"block_size", "queue_depth", "intra_op_parallelism"}
    # The snippet validates as part of a config.
    strata.validate_config({"train_batch_size": 1, **r["config"]})
    assert "read" in r["report"] and r["paths"] == [str(tmp_path)]
    assert list(tmp_path.iterdir()) == []  # the data files are removed


def test_custom_lists_and_errors(tmp_path):
    r = strata.nvme_bench(path=[tmp_path], size=1 << 20, block_sizes=["64K"], queue_depths=[2], threads=[1],
                          modes=["write"], memory="plain", direct=False, seconds=0)
    assert [(p["mode"], p["block_size"], p["queue_depth"]) for p in r["points"]] == [("write", 65536, 2)]
    assert r["best_read"] is None
    with pytest.raises(ValueError, match="not a positive multiple of 4096"):
        strata.nvme_bench(path=tmp_path, block_sizes=[1000], quick=True)
    with pytest.raises(ValueError, match="read or write"):
        strata.nvme_bench(path=tmp_path, modes=["append"], quick=True)
    with pytest.raises(FileNotFoundError, match="missing"):
        strata.nvme_bench(path=tmp_path / "missing", quick=True, size="1MiB", seconds=0, memory="plain", direct=False)
