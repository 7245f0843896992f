"""The configuration model through the Python package."""

import json
import pathlib

import pytest

strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_defaults_filled_and_batch_derived():
    cfg = strata.validate_config({"train_batch_size": 32}, world_size=4)
    assert cfg["train_micro_batch_size_per_gpu"] == 8
    assert cfg["gradient_accumulation_steps"] == 1
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["aio"]["block_size"] == 1 << 20


def test_every_error_reported_with_its_path():
    with pytest.raises(strata.ConfigError) as e:
        strata.validate_config(
            {
                "train_batch_size": 8,
                "zero_optimization": {"offload_optimizer": {"device": "gpu", "pinmemory": True}},
                "optimizer": {"params": {"lr": "auto"}},
            }
        )
    errors = e.value.errors
    assert len(errors) == 3, errors
    text = "\n".join(errors)
    assert "zero_optimization.offload_optimizer.pinmemory: unknown key; did you mean pin_memory?" in text
    assert 'zero_optimization.offload_optimizer.device: "gpu" is not one of none, cpu, nvme' in text
    assert "optimizer.params.lr" in text and "auto" in text


def test_file_path_and_sizes(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "strata": {"host_budget": "1.5GiB"}}))
    cfg = strata.validate_config(p)
    assert cfg["strata"]["host_budget"] == 1610612736
    with pytest.raises(FileNotFoundError):
        strata.validate_config(tmp_path / "missing.json")


def test_bytes():
    assert strata.parse_bytes("512MiB") == 512 << 20
    assert strata.format_bytes(3 << 29) == "1.5 GiB"
    with pytest.raises(ValueError, match="unknown unit"):
        strata.parse_bytes("12XB")


def test_docs_config_md_matches_the_code():
    doc = (REPO / "docs" / "config.md").read_text()
    assert doc == strata._strata.config_reference_markdown(), (
        "docs/config.md is stale: regenerate with "
        "build/bin/strata-config defaults --markdown > docs/config.md"
    )


def test_topology_has_a_numa_node():
    assert "NUMA nodes:" in strata.topology()
