"""Sizes to the memory (FitToMemory, docs/tuning.md section 4): with DeepSpeed's ZeRO-Infinity
section and no sizing key, a room smaller than the default keys' plan makes the engine lower
the keys left out until the plan fits, say so, and train; a key written out is kept; a room
nothing fits is refused at start. The room here is strata.host_budget (any machine, no root);
bench/infinity_limit.py does the same under a memory cgroup."""

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

MIB = 1 << 20


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])


def infinity(swap, host_budget, **param):
    swap.mkdir()
    return {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 3,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(swap)},
                                  "offload_param": {"device": "nvme", "nvme_path": str(swap), **param}},
            "strata": {"host_budget": host_budget}}


def train(m, cfg, steps=2):
    engine, *_ = strata.initialize(model=m, config=cfg, blocks=list(m))
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(2, 512, generator=gen)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.close()
    return losses


def sized_lines(err):
    return [line for line in err.splitlines() if "engine: sized to the memory:" in line]


def test_the_keys_left_out_are_lowered_to_the_room_and_it_trains(tmp_path, capfd):
    # 2.1M fp32 parameters: DeepSpeed's keys plan about 45 MiB for this rank (max_in_cpu keeps
    # every working shard in host memory, five parameter buffers, the CPU device's gathered
    # groups up to max_live 1e9: the whole model), the lowered ones about half of that.
    losses = train(model(), infinity(tmp_path / "a", 32 * MIB))
    assert all(l == l and l < 1e6 for l in losses), losses
    lines = sized_lines(capfd.readouterr().err)
    assert any("zero_optimization.offload_param.max_in_cpu 1000000000 -> 0" in l for l in lines), lines
    assert all("left under strata.host_budget" in l for l in lines), lines
    # Written out, max_in_cpu is kept (its shards stay in host memory); the others still give way.
    train(model(), infinity(tmp_path / "b", 40 * MIB, max_in_cpu=1000000000), steps=1)
    lines = sized_lines(capfd.readouterr().err)
    assert lines and not any("max_in_cpu" in l for l in lines), lines


def test_a_room_nothing_fits_is_refused_at_start(tmp_path, capfd):
    # Lowered as far as it goes, the plan is still above strata.host_budget: initialize fails
    # on the host tier's first allocation past the budget, before any step.
    with pytest.raises(Exception, match="host tier budget exhausted"):
        train(model(), infinity(tmp_path / "c", 4 * MIB), steps=1)
    lines = sized_lines(capfd.readouterr().err)
    assert any("as far as it goes" in l for l in lines), lines
