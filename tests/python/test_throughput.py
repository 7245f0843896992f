"""Model FLOPs, throughput and MFU from Python (strata.training_flops_per_token,
strata.throughput, strata.datasheet_peak_flops): core/throughput.h's one definition, the
one strata-train prints and bench/train_bench.py reports."""

import pytest

strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")


def test_flops_per_token_is_six_times_the_parameters_plus_attention():
    assert strata.training_flops_per_token(1e6, 2, 64, 32) == 6e6 + 12 * 2 * 64 * 32


def test_throughput_over_every_rank_and_mfu_against_the_peak():
    t = strata.throughput(1e9, 4096, 0.5, ranks=2, peak_flops_per_rank=4e12)
    assert t["tokens_per_s"] == 8192
    assert t["flops_per_s"] == pytest.approx(8.192e12)
    assert t["tflops"] == pytest.approx(8.192)
    assert t["mfu"] == pytest.approx(8.192 / 8)
    assert strata.throughput(1e9, 4096, 0.5)["mfu"] == 0  # no peak: no MFU
    assert strata.throughput(1e9, 4096, 0.0)["tflops"] == 0  # no time: zeros, not inf


def test_datasheet_peaks_by_the_name_cuda_reports():
    flops, source = strata.datasheet_peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    assert flops == pytest.approx(989.4e12) and source == "H100 SXM datasheet, dense bf16"
    assert strata.datasheet_peak_flops("NVIDIA H200", "fp32")[0] == pytest.approx(66.9e12)
    assert strata.datasheet_peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None
