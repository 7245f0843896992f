"""bench/train_bench.py runs (a smoke test of the program, not a measurement): a tiny GPT
through Strata and plain PyTorch on the CPU, results in its JSON, and argument errors."""

import importlib.util
import json
import math
import pathlib
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_script  # noqa: E402

TINY = ["--device", "cpu", "--layers", "2", "--dim", "64", "--heads", "4", "--vocab", "256", "--seq", "32",
        "--batch", "2", "--steps", "2", "--warmup", "1"]


def run(args, tmp_path):
    return bench_script.run("train_bench.py", args, tmp_path, omp_threads=1)


def test_strata_and_torch_train_the_same_model(tmp_path):
    out = tmp_path / "r.json"
    p = run(TINY + ["--peers", "strata,torch,deepspeed", "--json", str(out)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    if importlib.util.find_spec("deepspeed") is None:
        assert "deepspeed: not installed" in p.stdout
    r = json.loads(out.read_text())
    assert r["args"]["peak_source"].startswith(f"measured {r['args']['dtype']} GEMM peak")
    peers = {x["peer"]: x for x in r["results"]}
    assert {"strata", "torch"} <= set(peers)
    for x in peers.values():
        assert x["tokens_per_s"] > 0 and x["tflops"] > 0 and len(x["losses"]) == 3
        # MFU against the CPU's GEMM peak measured at start in the run's dtype: positive,
        # below 1 (an fp32 peak put bf16 runs above 1 on CPUs with AVX-512-BF16).
        assert 0 < x["mfu"] < 1
        assert set(x["phases_s"]) == {"forward", "backward", "step"}
    # Same initial values and batch: the first losses agree (bf16 in both, computed differently).
    assert abs(peers["strata"]["losses"][0] - peers["torch"]["losses"][0]) < 0.05
    assert peers["strata"]["exposed_s_per_step"]["optimizer_step"] > 0
    assert r["parameters"] > 0


def test_the_early_step_peer_gives_the_same_losses(tmp_path):
    """strata-early: the same model with strata.early_step (and skip_inf_nan_steps false),
    whose step is bit-identical to the plain pipelined step's: the same losses, every step
    early with some groups' updates begun in the backward, its trace beside the plain peer's."""
    out = tmp_path / "r.json"
    trace = tmp_path / "t.json"
    p = run(TINY + ["--peers", "strata,strata-early", "--json", str(out), "--trace", str(trace)], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    peers = {x["peer"]: x for x in json.loads(out.read_text())["results"]}
    assert peers["strata-early"]["losses"] == peers["strata"]["losses"]
    assert peers["strata-early"]["steps_early"] == 3 and peers["strata"]["steps_early"] == 0
    # Some groups' updates began in the backward (the toy's blocks; the root goes at its end).
    early = peers["strata-early"]
    assert 0 < early["groups_released_in_backward_per_step"] < early["groups"]
    assert peers["strata"]["groups_released_in_backward_per_step"] is None
    # After the first step the norm's whole tiles are summed as the gradients are written
    # (statistics()["optimizer"]["norm_tiles_as_written"]), in both peers alike, and every
    # step after the first leaves its spent gradients in place (lazy zeroing).
    for x in peers.values():
        assert x["norm_tiles_as_written"] > 0
        assert x["acc_chunks_zeroed_lazily_per_step"] > 0
    assert peers["strata-early"]["strata_set"] == {"early_step": True, "skip_inf_nan_steps": False}
    assert json.loads(trace.read_text()) and json.loads((tmp_path / "t-early.json").read_text())


def test_strata_variant_peers_run_in_rounds(tmp_path):
    """strata:KEY=JSON+KEY=JSON: the strata peer with those keys set too (here two whose
    settings give bit-identical training), its trace beside the plain peer's; --rounds 2
    runs the peers in turn twice and ends with each one's median."""
    out = tmp_path / "r.json"
    trace = tmp_path / "t.json"
    variant = "strata:accumulate_in_background=false+norm_in_backward=false"
    p = run(TINY + ["--peers", f"strata,{variant}", "--rounds", "2", "--json", str(out), "--trace", str(trace)],
            tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads(out.read_text())["results"]
    assert [(x["peer"], x["round"]) for x in results] == [("strata", 0), (variant, 0), ("strata", 1), (variant, 1)]
    assert results[1]["strata_set"] == {"accumulate_in_background": False, "norm_in_backward": False}
    assert results[0]["strata_set"] == {}
    for x in results[1:]:
        assert x["losses"] == results[0]["losses"]
    assert "round 2 of 2" in p.stdout and "medians over 2 rounds" in p.stdout
    assert f"  {variant}: " in p.stdout.split("medians over 2 rounds")[1]
    assert json.loads((tmp_path / "t-accumulate_in_background=false-norm_in_backward=false.json").read_text())


def test_a_dotted_variant_key_is_a_path_from_the_configs_root(tmp_path):
    """strata:zero_optimization.reduce_bucket_size=1: a bucket per group (a bucket holds at
    least the largest group), so more buckets per step than DeepSpeed's default (5e8,
    written out with --strata-set, so not sized from the model): one bucket; the same
    losses (each accumulator element gets the same additions in the same order). The root
    group's final norm gets its gradients first and the tied embedding last: after the
    first backward the norm's gradients wait in the reducer's park, so the root group is
    reduced once a step, as in the one bucket (the first step reduced it twice)."""
    out = tmp_path / "r.json"
    variant = "strata:zero_optimization.reduce_bucket_size=1"
    p = run(TINY + ["--peers", f"strata,{variant}", "--json", str(out),
                    "--strata-set", "zero_optimization.reduce_bucket_size=500000000"], tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    base, small = json.loads(out.read_text())["results"]
    assert base["strata_set"] == {"zero_optimization.reduce_bucket_size": 500000000}
    assert small["strata_set"] == {"zero_optimization.reduce_bucket_size": 1}
    assert base["buckets_per_step"] == 1
    assert small["buckets_per_step"] > 1 and small["buckets_launched_in_backward_per_step"] >= 1
    assert small["losses"] == base["losses"]
    assert small["gradients_parked_per_step"] > 0
    steps = 3  # --warmup 1 --steps 2
    extra = small["reduce_scatter_bytes_per_step"] * steps - base["reduce_scatter_bytes_per_step"] * steps
    # Only the first backward's second reduction of the root group (the embedding 256 x 64,
    # the positions and the norm: about 18K of the model's ~0.12M elements); with the root
    # reduced twice every step it would be 3 times that, above a third of the model.
    assert 0 < extra < base["reduce_scatter_bytes_per_step"] / 3
    p = run(TINY + ["--peers", "strata:zero_optimization.stage.x=1"], tmp_path)
    assert p.returncode == 1 and "strata:zero_optimization.stage.x=1: FAILED" in p.stdout
    assert "'stage' is not a section" in p.stdout


def test_accumulation_sums_micro_steps_on_the_device(tmp_path):
    """--model tiny --accumulation 2: each step is two micro-steps and one optimizer step
    for every peer (a loss per micro-step; tokens per optimizer step). Strata sums the
    micro-steps' gradients on the device (strata.accumulate_on_device, the default) and
    CPU-Adam reads those sums (no host accumulators): the same losses as summing them on
    the host; per optimizer step one copy per sub-group (fp32) instead of one per group and
    micro-step (bf16: the same bytes, with one bucket: DeepSpeed's 5e8 written out; sized
    from the model, each of several buckets' shards would add its own padding), and the
    optimizer's host memory per parameter 12 bytes
    and the sums' few buffers instead of 16; torch scales its loss by 1/2 and steps once,
    and starts from the same loss."""
    out = tmp_path / "r.json"
    variant = "strata:accumulate_on_device=false"
    args = ["--device", "cpu", "--model", "tiny", "--batch", "2", "--steps", "2", "--warmup", "1",
            "--accumulation", "2", "--peers", f"strata,{variant},torch", "--json", str(out),
            "--strata-set", "zero_optimization.sub_group_size=4096",
            "--strata-set", "zero_optimization.reduce_bucket_size=500000000"]
    p = run(args, tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "x 2 micro-step(s) per optimizer step" in p.stdout
    r = json.loads(out.read_text())
    assert r["args"]["layers"] == 2 and r["args"]["dim"] == 64 and r["args"]["accumulation"] == 2
    peers = {x["peer"]: x for x in r["results"]}
    device, host, torch_ = peers["strata"], peers[variant], peers["torch"]
    for x in (device, host, torch_):
        assert len(x["losses"]) == 6
    assert device["losses"] == host["losses"]
    assert device["gradient_accumulation"] == "device"
    assert host["gradient_accumulation"] == "host (strata.accumulate_on_device false)"
    assert device["grad_accumulators"].startswith("device (")
    assert host["grad_accumulators"].startswith("host")
    assert device["grad_copy_bytes_per_step"] == host["grad_copy_bytes_per_step"] > 0
    # Sub-groups of 4096 elements (16 KiB of fp32 sums each).
    assert device["grad_copies_per_step"] == math.ceil(device["grad_copy_bytes_per_step"] / 16384)
    assert host["grad_copies_per_step"] > 2
    assert 12 < device["optimizer_host_bytes_per_param"] < 12.5
    assert host["optimizer_host_bytes_per_param"] == pytest.approx(16, abs=0.01)
    assert "gradient accumulation: device;" in p.stdout
    assert "accumulators CPU-Adam reads: device (" in p.stdout
    assert abs(device["losses"][0] - torch_["losses"][0]) < 0.05
    # Per optimizer step: 2 x 2 sequences of 32 tokens.
    assert device["tokens_per_s"] == pytest.approx(128 / device["step_s"])


def test_bad_arguments_are_refused(tmp_path):
    p = run(["--device", "cpu", "--dim", "65", "--heads", "4"], tmp_path)
    assert p.returncode == 2 and "--dim must be a multiple of --heads" in p.stderr
    p = run(TINY + ["--peers", "megatron"], tmp_path)
    assert p.returncode == 2 and "unknown peer megatron" in p.stderr
    p = run(TINY + ["--peers", "strata:early_step"], tmp_path)
    assert p.returncode == 2 and "expected strata:KEY=JSON" in p.stderr
    p = run(TINY + ["--peers", "strata:early_step=yes"], tmp_path)
    assert p.returncode == 2 and "the value of early_step is not JSON" in p.stderr
    p = run(TINY + ["--peers", "strata,strata"], tmp_path)
    assert p.returncode == 2 and "names a peer twice" in p.stderr
    p = run(TINY + ["--rounds", "0"], tmp_path)
    assert p.returncode == 2 and "--rounds must be at least 1" in p.stderr
    p = run(TINY + ["--accumulation", "0"], tmp_path)
    assert p.returncode == 2 and "--accumulation must be at least 1" in p.stderr
    p = run(["--device", "cpu", "--model", "7b"], tmp_path)
    assert p.returncode == 2 and "invalid choice: '7b'" in p.stderr
