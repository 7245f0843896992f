"""strata.initialize: the Python ZeRO-3 front end over EngineCore, against torch.optim.Adam."""

import collections
import os
import pathlib
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import ranks  # noqa: E402
import toy_model  # noqa: E402

STEPS = 20
GLOBAL_BATCH = 8

# The single-rank tests run on the CPU device and, where a GPU is, on cuda:0 (their ids
# end in [cuda]; SKIPPED without one). NCCL cannot run two ranks on one GPU: the two-rank
# tests run on the CPU only.
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no usable CUDA device (torch.cuda.is_available() is False)"
)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=needs_cuda)])
def device(request):
    return torch.device(request.param)


def relocating_name(name):
    """A store's name as the engine reports it: with STRATA_TEST_RELOCATING_STORE=1 (the test
    command's second pass) every store is in its relocating test mode."""
    if os.environ.get("STRATA_TEST_RELOCATING_STORE") == "1":
        return name + " (relocating test mode)"
    return name


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


def check_matches(engine, losses, ref_losses, ref_model=None):
    """One rank against the one-process reference: the loss at every step, and (with
    ref_model) the gathered parameters."""
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert rel(a, b) <= 1e-5, f"step {step}: strata {a} reference {b}"
    if ref_model is None:
        return
    params = engine.gather_parameters()
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(params[name], p.detach().cpu(), rtol=1e-5, atol=1e-6, msg=name)


def train(engine, steps=STEPS, batch=GLOBAL_BATCH, device="cpu"):
    losses = []
    for x, y in toy_model.batches(steps, batch, device=device):
        loss = toy_model.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_single_rank_matches_torch_adam(device):
    ref_losses, ref_model = toy_model.reference_losses(STEPS, GLOBAL_BATCH, device=device)
    model = toy_model.make_model().to(device)
    engine, optimizer, none, scheduler = strata.initialize(
        model=model, config=toy_model.config(GLOBAL_BATCH, 1), model_parameters=model.parameters()
    )
    assert none is None and scheduler is None
    assert engine.rank == 0 and engine.world_size == 1
    losses = train(engine, device=device)
    check_matches(engine, losses, ref_losses, ref_model)
    stats = engine.statistics()
    assert stats["optimizer"]["steps_applied"] == STEPS
    assert stats["optimizer_tier"] == "host"
    assert stats["micro_steps"] == STEPS
    assert engine.get_lr() == [pytest.approx(1e-2)]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2)
    engine.close()


@pytest.mark.parametrize("params_on_nvme", [False, True], ids=["optimizer", "optimizer+params"])
def test_optimizer_states_on_nvme_match_the_host_tier(tmp_path, params_on_nvme, device):
    """offload_optimizer.device = nvme (and offload_param.device = nvme): the same losses and
    parameters as the host tier, bit for bit, with the states (and the working shards) in
    swap files that are gone when the engine closes. On cuda:0 the NVMe buffers are
    registered with CUDA and the shards staged from them."""
    results = []
    for nvme in (False, True):
        model = toy_model.make_model().to(device)
        config = toy_model.config(GLOBAL_BATCH, 1)
        config["zero_optimization"]["sub_group_size"] = 300
        if nvme:
            config["zero_optimization"]["offload_optimizer"] = {
                "device": "nvme", "nvme_path": [str(tmp_path)], "buffer_count": 12,
                "pipeline_read": True, "pipeline_write": True}
            if params_on_nvme:
                # Fewer buffers than groups: shards are read back (and ahead) every step;
                # max_in_cpu 0: none kept in host memory (the default keeps this small
                # model's all there).
                config["zero_optimization"]["offload_param"] = {
                    "device": "nvme", "nvme_path": [str(tmp_path)], "buffer_count": 3,
                    "max_in_cpu": 0}
        engine, *_ = strata.initialize(model=model, config=config)
        losses = train(engine, steps=6, device=device)
        stats = engine.statistics()
        results.append((losses, engine.gather_parameters(), stats))
        engine.close()
    (host_losses, host_params, host_stats), (losses, params, stats) = results
    assert losses == host_losses
    for name, p in host_params.items():
        assert torch.equal(params[name], p), name
    assert host_stats["optimizer_tier"] == "host"
    assert host_stats["optimizer_store"]["name"].startswith("host")  # or its relocating mode
    assert stats["optimizer_tier"] == "nvme"
    store = stats["optimizer_store"]
    assert store["name"] == relocating_name("nvme") and store["writes"] > 0
    assert store["chunks"] == 4 * stats["optimizer"]["sub_groups"] > 4
    assert "nvme states:" in stats["summary"]
    # The swap files are unlinked (du does not see them): the statistics say their size on
    # disk, at least the states' bytes (two slots a chunk where writes go to a fresh one).
    assert store["swap_bytes"] >= store["state_bytes"] > 0, store
    assert "swap files " in stats["summary"] and "on disk (unlinked: df counts them" in stats["summary"]
    if params_on_nvme:
        assert stats["param_tier"] == "nvme"
        shards = stats["param_store"]
        assert shards["swap_bytes"] >= shards["state_bytes"] > 0, shards
        assert shards["name"] == relocating_name("nvme") and shards["chunks"] > 3  # a shard per group
        assert shards["reads"] > 0 and shards["writes"] > 0
        # The toy's groups are all persistent: re-gathered after every step, each shard read
        # while the one before is gathered.
        assert stats["coordinator"]["shard_reads_ahead"] > 0
        if relocating_name("nvme") == "nvme":  # (a relocating store reads every lease back)
            assert stats["coordinator"]["shard_reads_on_demand"] == 0
        assert "nvme working shards:" in stats["summary"]
        assert stats["working_shard_host_bytes"] == 0
        # The pipelined step (the default) with the shards on NVMe: each new shard went
        # through a staging buffer into the store as the next forward opened its group (the
        # buffer itself: exchanged for one of the store's, no copy).
        optimizer = stats["optimizer"]
        assert optimizer["steps_pipelined"] == optimizer["steps_applied"] > 0
        assert optimizer["shard_handovers"] > 0
        assert optimizer["shard_handovers_exchanged"] == optimizer["shard_handovers"]
        assert shards["exchanges"] >= optimizer["shard_handovers"]
        # Their block CRCs computed on CPU-Adam's threads, not by the store's write.
        assert optimizer["shard_handovers_checksummed"] == optimizer["shard_handovers"]
        assert shards["writes_with_given_crcs"] == optimizer["shard_handovers"]
        assert optimizer["shard_checksum_s"] > 0
        assert "with their CRCs from CPU-Adam's threads" in stats["summary"]
        assert 1 <= optimizer["staging_buffers"]
    else:
        assert stats["param_store"]["name"] != "nvme"
    assert list(tmp_path.iterdir()) == []


def test_a_failed_pipelined_update_voids_the_iteration_and_training_goes_on(
    tmp_path, monkeypatch, device
):
    """The optimizer states on NVMe with the pipelined step (on by default): a read that
    fails in step 2's update (on the update's worker, after step() returned) is reported by
    the next backward as an OSError saying the iteration is void. The engine stays usable:
    the states are the last completed step's, and training again from there (the batches
    from step 2 on) ends with the host tier's losses and parameters, bit for bit."""
    steps = 6
    data = list(toy_model.batches(steps, GLOBAL_BATCH, device=device))
    results = []
    for nvme in (False, True):
        model = toy_model.make_model().to(device)
        config = toy_model.config(GLOBAL_BATCH, 1)
        config["zero_optimization"]["sub_group_size"] = 100  # 6 or more sub-groups
        if nvme:
            config["zero_optimization"]["offload_optimizer"] = {
                "device": "nvme", "nvme_path": [str(tmp_path)], "buffer_count": 12}
            monkeypatch.setenv("STRATA_TEST_FAIL_UPDATE_READ", "2")
        engine, *_ = strata.initialize(model=model, config=config)
        monkeypatch.delenv("STRATA_TEST_FAIL_UPDATE_READ", raising=False)
        losses, errors, step = [], [], 0
        while step < steps:
            x, y = data[step]
            loss = toy_model.loss_fn(engine(x), y)
            try:
                engine.backward(loss)
            except OSError as exc:
                errors.append(str(exc))
                # The voided forward's loss again: refused (by the engine, or by autograd,
                # whose graph the failed backward partly freed); the engine stays usable.
                with pytest.raises(RuntimeError):
                    engine.backward(loss)
                step = engine.statistics()["optimizer"]["steps_applied"]
                del losses[step:]
                continue
            engine.step()
            losses.append(loss.item())
            step += 1
        stats = engine.statistics()
        results.append((losses, errors, engine.gather_parameters(), stats))
        engine.close()
    (host_losses, host_errors, host_params, _), (losses, errors, params, stats) = results
    assert host_errors == []
    assert len(errors) == 1, errors
    assert "reading state" in errors[0] and "iteration are void" in errors[0], errors[0]
    assert "last completed step" in errors[0], errors[0]
    assert stats["optimizer"]["steps_failed"] == 1
    assert stats["optimizer"]["steps_applied"] == steps
    assert stats["optimizer"]["steps_pipelined"] == steps + 1
    assert losses == host_losses
    for name, p in host_params.items():
        assert torch.equal(params[name], p), name
    assert list(tmp_path.iterdir()) == []


def test_groups_and_zero_copy_parameters(device):
    model = toy_model.make_model().to(device)
    engine, *_ = strata.initialize(model=model, config=toy_model.config(GLOBAL_BATCH, 1))
    names = [g["name"] for g in engine.groups()]
    # Containers are looked into: each child of the Sequential blocks that has parameters.
    assert names == ["root", "emb", "blocks.0.0", "blocks.0.1", "blocks.0.3", "blocks.1.0",
                     "blocks.1.1", "blocks.1.3", "norm", "head"]
    lin = model.blocks[0][1]
    g = engine.group_of(lin.weight)
    seen = {}

    def pre(module, inputs):
        addrs = engine.full_buffer_addresses(g)
        seen["engine"] = addrs[:2]
        seen["tensors"] = [module.weight.data_ptr(), module.bias.data_ptr()]
        seen["shape"] = tuple(module.weight.shape)

    # Runs after the engine's pre-hook (hooks run in registration order).
    h = lin.register_forward_pre_hook(pre)
    x, y = next(toy_model.batches(1, GLOBAL_BATCH, device=device))
    loss = toy_model.loss_fn(engine(x), y)
    h.remove()
    assert seen["tensors"] == seen["engine"], seen
    assert seen["shape"] == (2 * toy_model.DIM, toy_model.DIM)
    # Released after the block's forward: the parameter keeps no memory.
    assert lin.weight.numel() == 0
    engine.backward(loss)
    engine.step()
    assert lin.weight.numel() == 0 and lin.weight.grad is None
    engine.close()


def test_eval_under_no_grad_and_blocks_argument(device):
    model = toy_model.make_model().to(device)
    engine, *_ = strata.initialize(
        model=model, config=toy_model.config(GLOBAL_BATCH, 1), blocks=[model.blocks[0], model.blocks[1]]
    )
    assert [g["name"] for g in engine.groups()] == ["root", "blocks.0", "blocks.1"]
    ref = toy_model.make_model().to(device)
    x, y = next(toy_model.batches(1, GLOBAL_BATCH, device=device))
    with torch.no_grad():
        a = engine(x)
        b = ref(x)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    losses = train(engine, steps=3, device=device)
    ref_losses, _ = toy_model.reference_losses(3, GLOBAL_BATCH, device=device)
    assert all(rel(p, q) <= 1e-5 for p, q in zip(losses, ref_losses))
    engine.close()


def test_timeline_shows_each_block_and_the_reductions_beside_the_backward(device, tmp_path):
    """engine.timeline(): the phases in order, every block's forward and backward inside its
    phase, each block's reduce-scatter issued before the backward ends (one bucket per block
    with overlap_comm), the CPU optimizer's passes; write_trace gives Chrome trace JSON."""
    import json

    model = toy_model.make_model().to(device)
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    cfg["zero_optimization"]["overlap_comm"] = True
    cfg["zero_optimization"]["reduce_bucket_size"] = max(
        sum(p.numel() for p in b.parameters()) for b in model.blocks)
    engine, *_ = strata.initialize(model=model, config=cfg, blocks=list(model.blocks))
    train(engine, steps=1, device=device)
    assert engine.timeline() == []  # off by default
    engine.enable_timeline()
    train(engine, steps=3, device=device)
    ev = engine.timeline()
    assert engine.timeline() == []  # taken
    phases = [e for e in ev if e["lane"] == "phase"]
    assert [e["name"] for e in phases] == ["forward", "backward", "step"] * 3
    for a, b in zip(phases, phases[1:]):
        assert a["start_us"] + a["duration_us"] <= b["start_us"] + 1e-3, (a, b)
    blocks = {g["name"] for g in engine.groups() if g["name"].startswith("blocks.")}
    backwards = [p for p in phases if p["name"] == "backward"]
    for name in blocks:
        fw = [e for e in ev if e["lane"] == "compute" and e["name"] == "forward " + name]
        bw = [e for e in ev if e["lane"] == "compute" and e["name"] == "backward " + name]
        assert len(fw) == 3 and len(bw) == 3, (name, fw, bw)
        rs = [e for e in ev if e["lane"] == "comm" and e["name"] == "reduce-scatter " + name]
        assert len(rs) == 3, (name, [e["name"] for e in ev if e["lane"] == "comm"])
        for r, b in zip(rs, backwards):
            assert b["start_us"] <= r["start_us"] < b["start_us"] + b["duration_us"], (name, r, b)
    assert any(e["lane"] == "optimizer" for e in ev)
    st = engine.statistics()
    assert st["phases"]["forwards"] == 4 and st["phases"]["backwards"] == 4 and st["phases"]["steps"] == 4
    assert st["phases"]["backward_s"] > 0
    assert st["reducer"]["buckets_overlapping_backward"] >= 3 * len(blocks)
    train(engine, steps=1, device=device)
    engine.write_trace(tmp_path / "t.json")
    doc = json.loads((tmp_path / "t.json").read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["cat"] for e in spans} >= {"phase", "compute", "comm", "optimizer"}
    assert [e["name"] for e in spans if e["cat"] == "phase"] == ["forward", "backward", "step"]
    with pytest.raises(ValueError, match="unknown lane"):
        engine.write_trace(tmp_path / "u.json", [dict(ev[0], lane="gpu")])
    assert not (tmp_path / "u.json").exists()
    engine.close()


def test_misuse_and_config_errors(device, tmp_path):
    model = toy_model.make_model().to(device)
    with pytest.raises(ValueError, match="train_batch_siz"):
        strata.initialize(model=model, config={"train_batch_siz": 8})
    with pytest.raises(NotImplementedError, match="client optimizer torch.optim.sgd.SGD cannot run"):
        strata.initialize(model=model, config=toy_model.config(8, 1), optimizer=torch.optim.SGD(model.parameters(), 0.1))
    engine, *_ = strata.initialize(model=model, config=toy_model.config(GLOBAL_BATCH, 1))
    with pytest.raises(RuntimeError, match="Step"):
        engine.step()
    x, y = next(toy_model.batches(1, GLOBAL_BATCH, device=device))
    loss = toy_model.loss_fn(engine(x), y)
    engine.backward(loss)
    with pytest.raises(RuntimeError, match="without step"):
        engine(x)
    engine.step()
    with torch.no_grad():
        out = engine(x)
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(out.sum())
    with pytest.raises(ValueError, match=r"save_latest=False\) is not supported"):
        engine.save_checkpoint(tmp_path, save_latest=False)
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        engine.load_checkpoint(tmp_path / "nothing-here", missing_ok=False)
    engine.close()


def test_numa_node_binds_cpu_adam_and_a_missing_node_is_refused(device):
    """strata.numa_node reaches CPU-Adam's threads (statistics()); -1 binds nothing without
    a GPU's PCI bus to look up; a node this machine lacks is refused with the key named."""
    model = toy_model.make_model().to(device)
    engine, *_ = strata.initialize(model=model, config=toy_model.config(GLOBAL_BATCH, 1))
    st = engine.statistics()
    if device.type == "cpu":
        assert st["numa_node"] == -1
    assert st["cpu_adam_threads"] >= 1
    # One rank: every core this process may use (strata.cpu_adam_threads 0).
    assert st["cpu_adam_ranks_sharing"] == 1 and st["cpu_adam_threads"] == st["cpu_adam_cores"]
    assert "CPU-Adam: " in st["summary"]
    engine.close(restore=True)  # the model again, for the next engine
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    cfg["strata"] = {"numa_node": 0}
    engine, *_ = strata.initialize(model=model, config=cfg)
    assert engine.statistics()["numa_node"] == 0
    assert "on NUMA node 0" in engine.statistics()["summary"]
    engine.close(restore=True)
    cfg["strata"] = {"numa_node": 1000}
    with pytest.raises(ValueError, match=r"strata.numa_node = 1000: this process may use NUMA node"):
        strata.initialize(model=model, config=cfg)


def test_forward_that_raises_leaves_the_engine_usable(device):
    """The model's own exception inside a block: it propagates, the blocks it left gathered
    are released (forward hooks do not run after an exception), and training goes on equal
    to torch."""
    ref_losses, _ = toy_model.reference_losses(3, GLOBAL_BATCH, device=device)
    model = toy_model.make_model().to(device)
    engine, *_ = strata.initialize(model=model, config=toy_model.config(GLOBAL_BATCH, 1))
    live = engine.statistics()["coordinator"]["live_elements"]

    def boom(module, inputs):
        raise KeyError("boom")

    h = model.blocks[1][1].register_forward_pre_hook(boom)  # after the engine's pre-hook
    x, _ = next(toy_model.batches(1, GLOBAL_BATCH, device=device))
    with pytest.raises(KeyError, match="boom"):
        engine(x)
    assert engine.statistics()["coordinator"]["live_elements"] == live
    with torch.no_grad(), pytest.raises(KeyError, match="boom"):
        engine(x)
    assert engine.statistics()["coordinator"]["live_elements"] == live
    h.remove()
    losses = train(engine, steps=3, device=device)
    check_matches(engine, losses, ref_losses)
    engine.close()


def run_ranks(tmp_path, world, mode):
    port = ranks.free_port()
    if mode in ("env", "groups", "lamb", "stage1", "stage2"):
        return ranks.run(tmp_path, HERE / "engine_worker.py", world, lambda r: [STEPS, GLOBAL_BATCH, mode],
                         lambda r: ranks.torchrun_env(r, world, port), timeout=240)
    return ranks.run(tmp_path, HERE / "engine_worker.py", world,
                     lambda r: [STEPS, GLOBAL_BATCH, mode, r, world, port], timeout=240)


def check_ranks_match(results, ref_losses, ref_model):
    """The ranks' mean loss is the one-process reference's at every step, and every rank's
    gathered parameters are the reference model's."""
    for step in range(STEPS):
        mean = sum(r["losses"][step] for r in results) / len(results)
        assert rel(mean, ref_losses[step]) <= 1e-5, f"step {step}: strata {mean} reference {ref_losses[step]}"
    for name, p in ref_model.named_parameters():
        for r in results:
            torch.testing.assert_close(torch.tensor(r["params"][name]), p.detach(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("mode", ["env", "torch_dist", "stage1", "stage2"])
def test_two_ranks_match_torch_adam(tmp_path, mode):
    """Two Gloo ranks, each with half of the batch: the mean of their losses is the
    one-process loss of the whole batch. env: torchrun's variables; torch_dist: a process
    group the ranks initialized first, whose store strata reuses."""
    results = run_ranks(tmp_path, 2, mode)
    ref_losses, ref_model = toy_model.reference_losses(STEPS, GLOBAL_BATCH)
    check_ranks_match(results, ref_losses, ref_model)
    # Each rank holds about half of the fp32 master parameters.
    total = sum(p.numel() for p in ref_model.parameters()) * 4
    for r in results:
        assert r["master_bytes"] < 0.75 * total
        # On several gloo ranks the gradient reductions have their own communicator.
        assert r["reduce_lane"] is True
        # The all-gathers stay on the engine's own communicator (no caller reaches it).
        assert r["gather_lane"] is False
        # Two processes with one machine's mask: CPU-Adam takes half of the cores each.
        threads, cores, sharing = r["cpu_adam"]
        assert sharing == 2 and threads == max(1, cores // 2), r["cpu_adam"]


def test_param_groups_match_torch_adamw_no_decay_recipe(device, tmp_path):
    """torch.optim-style groups: decay on matrices only, the biases and norms at twice the
    lr; against torch.optim.AdamW with the same groups, on one rank and on two."""
    ref_losses, ref_model = toy_model.recipe_reference(STEPS, GLOBAL_BATCH)
    model = toy_model.make_model().to(device)
    recipe = toy_model.recipe_groups(model)
    sizes = [len(g["params"]) for g in recipe]
    engine, optimizer, *_ = strata.initialize(
        model=model, config=toy_model.recipe_config(GLOBAL_BATCH, 1), model_parameters=recipe
    )
    groups = optimizer.param_groups
    assert [len(g["params"]) for g in groups] == sizes and sizes[0] > 0 and sizes[1] > 0
    assert groups[0]["lr"] == pytest.approx(toy_model.RECIPE_LR)
    assert groups[1]["lr"] == pytest.approx(2 * toy_model.RECIPE_LR)
    assert groups[1]["weight_decay"] == 0.0
    losses = train(engine, device=device)
    check_matches(engine, losses, ref_losses, ref_model)
    stats = engine.statistics()["optimizer"]
    assert stats["group_lr"] == [pytest.approx(toy_model.RECIPE_LR), pytest.approx(2 * toy_model.RECIPE_LR)]
    # Setting a group's lr sets the base rate that gives it that value.
    optimizer.param_groups[1]["lr"] = 0.5
    assert engine.get_lr() == [pytest.approx(0.25)]
    engine.close()
    if device.type == "cuda":
        return  # two ranks: gloo on the CPU only
    results = run_ranks(tmp_path, 2, "groups")
    check_ranks_match(results, ref_losses, ref_model)


def test_lamb_matches_the_float64_reference(device, tmp_path):
    """optimizer.type Lamb with the recipe's groups against the published algorithm in
    float64 (toy_model.Float64Lamb, DeepSpeed's clamp), on one rank and on two (parameters
    cut across ranks: the trust ratios need the all-reduced norms)."""
    ref_losses, ref_model, ref_opt = toy_model.lamb_reference(STEPS, GLOBAL_BATCH, device=device)
    # The clamp acts at both ends, so a wrong norm or a missing clamp shows.
    assert min(ref_opt.ratios) == toy_model.LAMB_MIN_COEFF and max(ref_opt.ratios) == toy_model.LAMB_MAX_COEFF
    model = toy_model.make_model().to(device)
    engine, *_ = strata.initialize(
        model=model, config=toy_model.lamb_config(GLOBAL_BATCH, 1), model_parameters=toy_model.recipe_groups(model)
    )
    losses = train(engine, device=device)
    check_matches(engine, losses, ref_losses, ref_model)
    stats = engine.statistics()["optimizer"]
    assert stats["lamb_norms_all_reduce_calls"] == STEPS
    assert toy_model.LAMB_MIN_COEFF <= stats["lamb_trust_ratio_min"] <= stats["lamb_trust_ratio_max"]
    assert stats["lamb_trust_ratio_max"] <= toy_model.LAMB_MAX_COEFF
    engine.close()
    if device.type == "cuda":
        return  # two ranks: gloo on the CPU only
    results = run_ranks(tmp_path, 2, "lamb")
    check_ranks_match(results, ref_losses, ref_model)


def test_param_group_errors():
    model = toy_model.make_model()
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    with pytest.raises(ValueError, match="parameter group 0 has 'amsgrad'"):
        strata.initialize(model=model, config=cfg, model_parameters=[{"params": model.parameters(), "amsgrad": True}])
    with pytest.raises(ValueError, match="in parameter groups 0 and 1"):
        strata.initialize(model=model, config=cfg, model_parameters=[{"params": [model.head.weight]},
                                                                     {"params": [model.head.weight]}])
    with pytest.raises(TypeError, match="mixes parameters and parameter-group dicts"):
        strata.initialize(model=model, config=cfg, model_parameters=[{"params": [model.head.weight]}, model.head.bias])
    with pytest.raises(ValueError, match="has no 'params'"):
        strata.initialize(model=model, config=cfg, model_parameters=[{"lr": 1.0}])


def check_stage_statistics(stats, stage, engine, applied):
    """Stages 1 and 2 keep every group gathered: no fetch in a pass, all-gathers only at
    initialize and after each applied step; stage 1 all-reduces the gradients, 2 and 3
    reduce-scatter them."""
    co, red = stats["coordinator"], stats["reducer"]
    groups = sum(1 for g in engine.groups() if g["numel"] > 0)  # an empty group needs no all-gather
    if stage < 3:
        assert co["fetches_on_demand"] + co["fetches_prefetched"] + co["fetches_reused"] == 0, co
        assert stats["all_gather"]["calls"] == groups * (1 + applied), stats["all_gather"]
    else:
        assert co["fetches_on_demand"] + co["fetches_prefetched"] + co["fetches_reused"] > 0, co
    if stage == 1:
        assert red["reduce_scatter_calls"] == 0 and red["all_reduce_calls"] > 0, red
    else:
        assert red["reduce_scatter_calls"] > 0 and red["all_reduce_calls"] == 0, red


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradient_accumulation_and_clipping_match_torch(device, stage):
    """Each ZeRO stage against torch.optim.Adam with clipping and accumulation."""
    steps, micro = 6, 4
    cfg = toy_model.config(2 * micro, 1)
    cfg.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=2, gradient_clipping=0.5)
    cfg["zero_optimization"]["stage"] = stage
    if stage == 3:  # the toy model's groups are small: without this they all stay gathered
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    model = toy_model.make_model().to(device)
    engine, *_ = strata.initialize(model=model, config=cfg)
    ref = toy_model.make_model().to(device)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for k, (x, y) in enumerate(toy_model.batches(2 * steps, micro, device=device)):
        loss = toy_model.loss_fn(engine(x), y)
        engine.backward(loss)
        assert engine.is_gradient_accumulation_boundary() == (k % 2 == 1)
        out = engine.step()
        assert out["applied"] == (k % 2 == 1)
        ref_loss = toy_model.loss_fn(ref(x), y)
        (ref_loss / 2).backward()
        if k % 2 == 1:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        assert rel(loss.item(), ref_loss.item()) <= 1e-5, k
    params = engine.gather_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach().cpu(), rtol=1e-5, atol=1e-6, msg=name)
    check_stage_statistics(engine.statistics(), stage, engine, steps)
    engine.close()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradient_accumulation_on_the_device_is_bit_identical_to_the_host(device, dtype):
    """strata.accumulate_on_device (on by default): every micro-step's reduced
    gradients are summed in device memory and CPU-Adam reads the sums from there, each
    sub-group copied to the host once per optimizer step (no host accumulators), with the
    same losses and parameters, bit for bit, as summing every micro-step's on the host
    (clipped, a bucket per block, three micro-steps a step); on cuda:0 the additions, the
    norm's tiles and the copies are the CUDA device's."""

    def run(on_device):
        cfg = toy_model.config(12, 1)
        cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3, gradient_clipping=0.5)
        if dtype == "bf16":
            cfg["bf16"] = {"enabled": True}
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, reduce_bucket_size=1,
                                        sub_group_size=64)
        cfg["strata"] = {"accumulate_on_device": on_device}
        engine, *_ = strata.initialize(model=toy_model.make_model().to(device), config=cfg)
        losses, copies = [], []
        for x, y in toy_model.batches(9, 4, device=device):
            loss = toy_model.loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            st = engine.statistics()
            copies.append(st["reducer"]["shard_copies"] + st["device_sums"]["fetches"])
        stats = engine.statistics()
        params = engine.gather_parameters()
        engine.close()
        return losses, params, copies, stats

    losses, params, copies, stats = run(True)
    host_losses, host_params, host_copies, host_stats = run(False)
    assert losses == host_losses
    for name, p in host_params.items():
        assert torch.equal(params[name], p), name
    assert stats["gradient_accumulation"] == "device"
    assert host_stats["gradient_accumulation"] == "host (strata.accumulate_on_device false)"
    assert stats["grad_accumulators"].startswith("device (")
    assert host_stats["grad_accumulators"].startswith("host")
    # Copies to the host only by the optimizer steps (after the 3rd, 6th and 9th
    # micro-steps), one per sub-group of 64 elements: by step() itself or by its pipelined
    # update beside the next forward (counted at the next micro-step); the host path copies
    # every micro-step's shards.
    per_micro = [b - a for a, b in zip([0] + copies, copies)]
    host_per_micro = [b - a for a, b in zip([0] + host_copies, host_copies)]
    assert [per_micro[k] for k in (0, 1, 4, 7)] == [0] * 4
    subs = stats["optimizer"]["sub_groups"]
    assert subs > 1
    assert per_micro[2] + per_micro[3] == subs
    assert per_micro[5] + per_micro[6] == subs
    assert all(n > 0 for n in host_per_micro)
    assert stats["reducer"]["shard_copies"] == 0
    assert stats["reducer"]["shards_added_on_device"] == host_copies[-1] > 0
    assert stats["reducer"]["device_accumulator_bytes"] > 0
    # The optimizer's store holds master, m and v (no accumulators): 4 bytes per element less.
    acc = stats["optimizer"]["master_bytes"]
    assert host_stats["optimizer_store"]["state_bytes"] - stats["optimizer_store"]["state_bytes"] == acc


def test_delayed_update_runs_one_step_behind_after_its_warmup(device, tmp_path):
    """strata.delayed_update (not exact): through the Python front end, the steps
    within the warm-up are the exact run's bit for bit; after it, the micro-steps use
    parameters one step old (the losses leave the exact run's), every later step counts as
    delayed, and a checkpoint saved mid-run resumes to the same bits (the save drains the
    update in flight)."""

    def engine_for(delayed):
        cfg = toy_model.config(8, 1)
        cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0)
        cfg["strata"] = {"delayed_update": delayed, "delayed_update_warmup": 2}
        engine, *_ = strata.initialize(model=toy_model.make_model().to(device), config=cfg)
        return engine

    def train(engine, batches):
        losses = []
        for x, y in batches:
            loss = toy_model.loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    batches = list(toy_model.batches(16, 4, device=device))  # 8 optimizer steps
    exact = engine_for(False)
    exact_losses = train(exact, batches)
    exact.close()
    delayed = engine_for(True)
    losses = train(delayed, batches[:10])
    delayed.save_checkpoint(str(tmp_path), tag="mid")
    losses += train(delayed, batches[10:])
    stats = delayed.statistics()
    params = delayed.gather_parameters()
    delayed.close()
    # Steps 0 and 1 exact (micro-steps 0-3), and step 2's micro-steps use step 1's update
    # (it was exact): the same bits through micro-step 5; step 3's use step 1's parameters.
    assert losses[:6] == exact_losses[:6]
    assert losses[6:] != exact_losses[6:]
    assert stats["delayed_update_steps"] == 6
    # At steps 3, 4, 6 and 7, and the save's (after step 4: step 5 had none to copy out).
    assert stats["delayed_copy_outs"] == 5
    resumed = engine_for(True)
    resumed.load_checkpoint(str(tmp_path), tag="mid")
    assert train(resumed, batches[10:]) == losses[10:]
    for name, p in resumed.gather_parameters().items():
        assert torch.equal(params[name], p), name
    resumed.close()


def test_early_step_is_bit_identical_and_starts_updates_during_the_backward(device):
    """strata.early_step: each block's update starts once its last gradient hook
    ran and its one-block bucket was reduced; the result is the step after the backward's,
    bit for bit, with gradient accumulation. set_lr between backward() and step() is refused."""

    def run(early):
        cfg = toy_model.config(8, 1)
        cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
        z = cfg["zero_optimization"]
        z.update(stage3_param_persistence_threshold=0, overlap_comm=True, reduce_bucket_size=1)
        cfg["strata"] = {"early_step": early, "skip_inf_nan_steps": False}
        engine, *_ = strata.initialize(model=toy_model.make_model().to(device), config=cfg)
        losses, norms = [], []
        for x, y in toy_model.batches(12, 4, device=device):
            loss = toy_model.loss_fn(engine(x), y)
            engine.backward(loss)
            out = engine.step()
            losses.append(loss.item())
            if out["applied"]:
                norms.append(out["global_norm"])
        params = engine.gather_parameters()
        stats = engine.statistics()["optimizer"]
        return engine, losses, norms, params, stats

    off, off_losses, off_norms, off_params, off_stats = run(False)
    early, losses, norms, params, stats = run(True)
    assert losses == off_losses
    assert norms == off_norms and len(norms) == 6
    for name, p in off_params.items():
        assert torch.equal(params[name], p), name
    assert off_stats["steps_early"] == 0
    assert stats["steps_early"] == 6
    assert stats["groups_released_in_backward"] > 0
    x, y = next(iter(toy_model.batches(1, 4, device=device)))
    early.backward(toy_model.loss_fn(early(x), y))  # the first micro-step of two
    early.step()
    early.backward(toy_model.loss_fn(early(x), y))
    with pytest.raises(RuntimeError, match="set the learning rate before the backward"):
        early.optimizer.param_groups[0]["lr"] = 0.5
    early.step()
    off.close()
    early.close()


class TiedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(toy_model.VOCAB, toy_model.DIM)
        self.pos = torch.nn.Parameter(torch.randn(toy_model.SEQ, toy_model.DIM) * 0.1)  # used in forward directly
        self.body = torch.nn.Linear(toy_model.DIM, toy_model.DIM)
        self.frozen = torch.nn.Linear(toy_model.DIM, toy_model.DIM)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(toy_model.DIM, toy_model.VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x) + self.pos
        return self.head(torch.tanh(self.frozen(self.body(h))))


def test_tied_direct_and_frozen_parameters(device):
    torch.manual_seed(3)
    model = TiedNet().to(device)
    torch.manual_seed(3)
    ref = TiedNet().to(device)
    engine, *_ = strata.initialize(model=model, config=toy_model.config(GLOBAL_BATCH, 1))
    groups = {g["name"]: [p[0] for p in g["params"]] for g in engine.groups()}
    # The tied weight (in two blocks) and the direct parameter live in the root group; the
    # frozen Linear is a block of frozen parameters only (a frozen child is a
    # block as a trainable one is, so a LoRA base's layers are partitioned and gathered
    # only around their use).
    assert groups == {
        "root": ["pos", "emb.weight"],
        "body": ["body.weight", "body.bias"],
        "frozen": [],
        "frozen:frozen": ["frozen.weight", "frozen.bias"],
    }
    assert [g["frozen"] for g in engine.groups()] == [False, False, False, True]
    # Released outside its forward and backward.
    assert model.frozen.weight.numel() == 0
    opt = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    for x, y in toy_model.batches(5, GLOBAL_BATCH, device=device):
        loss = toy_model.loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        ref_loss = toy_model.loss_fn(ref(x), y)
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert rel(loss.item(), ref_loss.item()) <= 1e-5
    params = engine.gather_parameters()
    for name in ("frozen.weight", "frozen.bias"):
        assert torch.equal(params[name], getattr(ref.frozen, name.split(".")[1]).detach().cpu()), name
    engine.close()


class HeadNet(torch.nn.Module):
    """Three blocks between an embedding and an output head: tied to the embedding (the root
    group then gets the final norm's gradients first and the embedding's last) or untied."""

    def __init__(self, tied):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 16)
        self.blocks = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3)]
        )
        self.norm = torch.nn.LayerNorm(16)
        self.head = None if tied else torch.nn.Linear(16, 64, bias=False)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        h = self.norm(h)
        return h @ self.emb.weight.t() if self.head is None else self.head(h)


def reduced_bytes_per_step(tied, bucket, head_as_block=False, steps=4):
    """Trains HeadNet on one rank; returns the bytes reduce-scattered at each step, the
    gradients parked, and the losses."""
    torch.manual_seed(5)
    model = HeadNet(tied)
    blocks = list(model.blocks) + ([model.head] if head_as_block else [])
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": bucket}}
    engine, *_ = strata.initialize(model=model, config=cfg, blocks=blocks)
    per_step, losses, before = [], [], 0
    gen = torch.Generator().manual_seed(9)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 12), generator=gen)
        loss = torch.nn.functional.cross_entropy(engine(x).flatten(0, 1), x.flatten())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        total = engine.statistics()["reducer"]["reduce_scatter_bytes"]
        per_step.append(total - before)
        before = total
    parked = engine.statistics()["reducer"]["gradients_parked"]
    engine.close()
    return per_step, parked, losses


def test_the_root_group_is_reduced_once_a_step():
    """A bucket per group: the tied root group's final norm gradients wait in the reducer's
    park from the second step on, so each step reduces what one bucket for the whole model
    does, with the same losses; an untied head in the root group still sends it out twice
    (its gradient is too large for the park), given as a block of its own it does not
    (docs/tuning.md)."""
    whole, parked, whole_losses = reduced_bytes_per_step(tied=True, bucket=500000000)
    assert len(set(whole)) == 1
    small, parked, losses = reduced_bytes_per_step(tied=True, bucket=1)
    assert small[0] > whole[0]  # the first step knows nothing of the order yet
    assert small[1:] == whole[1:]
    assert parked == 2 * 3  # the final norm's weight and bias, steps 2-4
    assert losses == whole_losses
    untied, parked, untied_losses = reduced_bytes_per_step(tied=False, bucket=1)
    untied_whole, _, _ = reduced_bytes_per_step(tied=False, bucket=500000000)
    assert parked == 0 and all(u > w for u, w in zip(untied, untied_whole))
    own, parked, own_losses = reduced_bytes_per_step(tied=False, bucket=1, head_as_block=True)
    own_whole, _, _ = reduced_bytes_per_step(tied=False, bucket=500000000, head_as_block=True)
    assert parked > 0 and own[1:] == own_whole[1:] and own[1] < untied[1]
    assert own_losses == untied_losses


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_trains(precision, device, stage):
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    cfg[precision] = {"enabled": True}
    cfg["zero_optimization"]["stage"] = stage
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if stage == 3:  # the toy model's groups are small: without this they all stay gathered
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    model = toy_model.make_model().to(device)
    engine, *_ = strata.initialize(model=model, config=cfg)
    # The working dtype computes directly (torch 2.x has fp16 and bf16 CPU kernels).
    seen = []
    model.head.register_forward_hook(lambda m, i, out: seen.append((m.weight.dtype, out.dtype)))
    want = torch.float16 if precision == "fp16" else torch.bfloat16
    ref_losses, _ = toy_model.reference_losses(5, GLOBAL_BATCH, device=device)
    losses = []
    for x, y in toy_model.batches(5, GLOBAL_BATCH, device=device):
        loss = toy_model.loss_fn(engine(x).float(), y)
        engine.backward(loss)
        out = engine.step()
        losses.append(loss.item())
    assert all(rel(a, b) < 3e-2 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert seen and all(s == (want, want) for s in seen), seen
    if precision == "fp16":
        assert out["loss_scale"] > 1
    stats = engine.statistics()
    check_stage_statistics(stats, stage, engine, stats["optimizer"]["steps_applied"])
    engine.close()


_LATE_COMPILE = """
import sys, warnings
import torch, strata
print("dynamo" if "torch._dynamo" in sys.modules else "none")
import test_engine, toy_model
engine, *_ = strata.initialize(model=toy_model.make_model(), config=toy_model.config(test_engine.GLOBAL_BATCH, 1))
print("dynamo" if "torch._dynamo" in sys.modules else "none")
x, _ = next(toy_model.batches(1, test_engine.GLOBAL_BATCH))
warnings.simplefilter("ignore")  # Dynamo's on sys._getframe, which it cannot trace
for compiled in (torch.compile(engine.module), torch.compile(engine)):
    try:
        compiled(x)
        print("compiled")
    except RuntimeError as e:
        print("refused" if "does not work under torch.compile" in str(e) else repr(e))
ref_losses, _ = toy_model.reference_losses(3, test_engine.GLOBAL_BATCH)
test_engine.check_matches(engine, test_engine.train(engine, steps=3), ref_losses)
print("trained")
"""


def test_dynamo_stays_unloaded_until_something_is_compiled():
    """Neither import strata nor strata.initialize imports torch._dynamo (which loads Triton:
    about 117 MiB more resident memory per rank that never compiles); a torch.compile after
    initialize is still refused with the clear error, both ways, and the engine then trains
    on eagerly. A fresh process: pytest's has Dynamo loaded."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.run([sys.executable, "-c", _LATE_COMPILE], capture_output=True, text=True, env=env, cwd=HERE,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [line for line in p.stdout.split("\n") if line and not line.startswith("[strata")] == [
        "none", "none", "refused", "refused", "trained"], p.stdout


def test_torch_compile_is_refused_with_a_clear_error(device):
    """A Strata-wrapped model does not work under torch.compile (README): Dynamo cannot
    trace the gather/release hooks and would silently run the model eagerly, so every way
    of compiling it raises, and the engine then trains on eagerly."""
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    with pytest.raises(ValueError, match="does not work under torch.compile"):
        strata.initialize(model=torch.compile(toy_model.make_model().to(device)), config=cfg)
    model = toy_model.make_model().to(device)
    model.blocks[0].compile()
    with pytest.raises(ValueError, match="Compiled here: blocks.0"):
        strata.initialize(model=model, config=cfg)

    engine, *_ = strata.initialize(model=toy_model.make_model().to(device), config=cfg)
    x, _ = next(toy_model.batches(1, GLOBAL_BATCH, device=device))
    with pytest.raises(RuntimeError, match="does not work under torch.compile"):
        torch.compile(engine.module)(x)
    with pytest.raises(RuntimeError, match="does not work under torch.compile"):
        torch.compile(engine)(x)
    ref_losses, _ = toy_model.reference_losses(3, GLOBAL_BATCH, device=device)
    losses = train(engine, steps=3, device=device)
    check_matches(engine, losses, ref_losses)
    engine.close()


# ---- On a GPU (SKIPPED without one): cuda:0, NCCL for the device buffers and gloo for the
# host's, one rank (NCCL cannot run two ranks on one GPU; the test machines have one).

@needs_cuda
def test_cuda_takes_a_cpu_model_with_strata_device_cuda():
    """A model built on the CPU trains on cuda:0 when the config says so (the model-on-CUDA
    case is every [cuda] test above)."""
    ref_losses, ref_model = toy_model.reference_losses(STEPS, GLOBAL_BATCH, device="cuda")
    model = toy_model.make_model()
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    cfg["strata"] = {"device": "cuda"}
    engine, *_ = strata.initialize(model=model, config=cfg)
    assert engine.device == torch.device("cuda", 0)
    assert "cuda" in engine.statistics()["device"]["name"]
    losses = train(engine, device=engine.device)
    check_matches(engine, losses, ref_losses, ref_model)
    stats = engine.statistics()
    assert stats["reducer"]["shard_copies"] > 0
    assert stats["working_shard_pushes"] == STEPS + 1
    engine.close()


@needs_cuda
def test_cuda_forward_and_backward_under_a_user_stream_match_torch():
    """Each step's forward, backward and step run under a user's torch.cuda.stream (two
    side streams, alternating, neither the default): the engine follows the current stream
    at every hook (its events and kernels go on it), and training matches torch's Adam as
    on the default stream."""
    ref_losses, ref_model = toy_model.reference_losses(STEPS, GLOBAL_BATCH, device="cuda")
    model = toy_model.make_model().cuda()
    engine, *_ = strata.initialize(model=model, config=toy_model.config(GLOBAL_BATCH, 1))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    losses = []
    for i, (x, y) in enumerate(toy_model.batches(STEPS, GLOBAL_BATCH, device="cuda")):
        s = streams[i % 2]
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            loss = toy_model.loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    torch.cuda.synchronize()
    check_matches(engine, losses, ref_losses, ref_model)
    engine.close()


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_half_precision_learns(precision):
    """40 steps in the half dtype on cuda:0 follow torch's fp32 Adam on the same GPU (the
    toy task learns slowly: fp32 itself ends about 3% below where it starts)."""
    ref_losses, _ = toy_model.reference_losses(40, GLOBAL_BATCH, device="cuda")
    model = toy_model.make_model().cuda()
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    cfg[precision] = {"enabled": True}
    engine, *_ = strata.initialize(model=model, config=cfg)
    losses = []
    for x, y in toy_model.batches(40, GLOBAL_BATCH):
        loss = toy_model.loss_fn(engine(x.cuda()), y.cuda())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert all(map(lambda v: v == v, losses)), losses
    # On the CPU device the same run stays within 1.1e-2 of fp32 at every step.
    assert all(rel(a, b) < 3e-2 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
    assert sum(losses[-3:]) < sum(losses[:3]), losses
    engine.close()


def test_strata_device_cuda_without_a_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the error is for machines without one")
    model = toy_model.make_model()
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    cfg["strata"] = {"device": "cuda"}
    with pytest.raises(ValueError, match="compute device is cuda:0 but torch sees 0 CUDA devices"):
        strata.initialize(model=model, config=cfg)


class _LoraLinear(torch.nn.Module):
    """A frozen Linear plus this test's own trainable low-rank update."""

    def __init__(self, n_in, n_out, r=4):
        super().__init__()
        self.base = torch.nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(r, n_in) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(n_out, r) * 0.1)
        self.r = r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * (2.0 / self.r)


class _LoraBlock(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.ln = torch.nn.LayerNorm(dim)  # trainable
        self.fc1 = _LoraLinear(dim, hidden)
        self.fc2 = _LoraLinear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class _LoraNet(torch.nn.Module):
    def __init__(self, vocab=48, dim=32, hidden=128, blocks=12):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.emb.requires_grad_(False)
        self.blocks = torch.nn.ModuleList(_LoraBlock(dim, hidden) for _ in range(blocks))
        self.head = torch.nn.Linear(dim, vocab)
        self.vocab = vocab

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _train_lora_as_torch(engine, ref, opt, device="cpu", steps=4):
    """Trains the engine and the plain model ``ref`` (its optimizer ``opt``) on the same
    token batches; each step's losses within 1e-5."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randint(0, 48, (4, 8), generator=gen).to(device)
        y = torch.randint(0, 48, (4, 8), generator=gen).to(device)
        loss = torch.nn.functional.cross_entropy(engine(x).float().reshape(-1, 48), y.reshape(-1))
        engine.backward(loss)
        engine.step()
        ref_loss = torch.nn.functional.cross_entropy(ref(x).reshape(-1, 48), y.reshape(-1))
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        assert rel(loss.item(), ref_loss.item()) <= 1e-5


def test_lora_frozen_base_four_times_the_device_budget_matches_torch(device):
    """The frozen base (requires_grad False) is partitioned, gathered and
    offloaded with no optimizer state; with a device budget a quarter of it the model trains
    as torch.optim.AdamW over the trainable parameters, the frozen base unchanged."""
    torch.manual_seed(5)
    ref = _LoraNet().to(device)
    torch.manual_seed(5)
    model = _LoraNet().to(device)
    frozen_bytes = sum(p.numel() * 4 for p in ref.parameters() if not p.requires_grad)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    initial = {n: p.detach().cpu().clone() for n, p in ref.named_parameters()}
    cfg = toy_model.config(4, 1)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    cfg["zero_optimization"].update(
        {
            "offload_param": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 1500,
        }
    )
    cfg["strata"] = {"device_budget": frozen_bytes // 4}
    engine, *_ = strata.initialize(model=model, config=cfg, blocks=list(model.blocks))
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    _train_lora_as_torch(engine, ref, opt, device)
    params = engine.gather_parameters()
    for name, p in ref.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(params[name], p.detach().cpu(), rtol=1e-5, atol=1e-6, msg=name)
            assert not torch.equal(params[name], initial[name]), f"{name} did not train"
        else:
            assert torch.equal(params[name], initial[name]), f"{name} (frozen) changed"
    stats = engine.statistics()
    trainable_numel = sum(p.numel() for p in trainable)
    # Master, m and v for the trainable parameters only (plus alignment padding per group).
    assert stats["optimizer"]["master_bytes"] < (trainable_numel + 16 * 2 * len(engine.groups())) * 4
    assert stats["working_shard_bytes"] >= frozen_bytes
    assert frozen_bytes >= 4 * cfg["strata"]["device_budget"]
    assert stats["device"]["peak_bytes"] <= cfg["strata"]["device_budget"]
    engine.close()


def test_a_block_of_frozen_parameters_only_is_released_after_its_backward():
    """A block with no trainable parameter has no gradient to say its backward is over: the
    gradient reaching its inputs does (strata releases it then, not at the end of the
    backward). Checked from the earlier block's weight gradient hook."""
    torch.manual_seed(0)
    dim = 16

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(dim, dim)
            self.f = torch.nn.Linear(dim, dim)
            self.f.requires_grad_(False)
            self.b = torch.nn.Linear(dim, dim)

        def forward(self, x):
            return self.b(torch.tanh(self.f(torch.tanh(self.a(x)))))

    model = Net()
    cfg = toy_model.config(4, 1)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = strata.initialize(model=model, config=cfg, blocks=[model.a, model.f, model.b])
    names = [g["name"] for g in engine.groups()]
    assert names == ["root", "a", "f", "b", "f:frozen"], names
    seen = []
    model.a.weight.register_hook(lambda grad: seen.append(model.f.weight.numel()))
    for _ in range(2):
        loss = engine(torch.randn(4, dim)).square().mean()
        engine.backward(loss)
        engine.step()
    assert seen == [0, 0], seen  # f released before a's gradient was computed
    engine.close()


def test_frozen_parameters_passed_in_model_parameters_stay_frozen():
    """DeepSpeed's idiom passes model.parameters() whole, frozen ones among them: those stay
    frozen (their values do not move, they get no optimizer state) and the others train as
    with the frozen ones left out."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        model[1].requires_grad_(False)
        return model

    cfg = toy_model.config(4, 1)
    runs = []
    for given in (lambda m: m.parameters(), lambda m: [p for p in m.parameters() if p.requires_grad]):
        model = build()
        frozen0 = model[1].weight.detach().clone()
        engine, *_ = strata.initialize(model=model, config=cfg, model_parameters=given(model))
        assert [g["name"] for g in engine.groups()] == ["root", "0", "1", "2", "1:frozen"]
        torch.manual_seed(1)
        for _ in range(2):
            engine.backward(engine(torch.randn(4, 8)).square().mean())
            engine.step()
        params = engine.gather_parameters()
        assert torch.equal(params["1.weight"], frozen0)
        assert not torch.equal(params["0.weight"], build()[0].weight.detach())
        runs.append(params)
        engine.close()
    for name in runs[0]:
        assert torch.equal(runs[0][name], runs[1][name]), name


class _BareLoraBlock(torch.nn.Module):
    """Adapters only, no trainable norm in front: the first adapter's gradient is the
    block's last, and it arrives before the frozen fc1.base has given the input's."""

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = _LoraLinear(dim, hidden)
        self.fc2 = _LoraLinear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _CheckpointedLoraNet(_LoraNet):
    """_LoraNet of _BareLoraBlocks that may run under torch.utils.checkpoint ("reentrant" or
    "non_reentrant"); its embedding is frozen, so the first block's input requires no grad."""

    def __init__(self, mode, blocks=3):
        super().__init__(blocks=blocks)
        self.blocks = torch.nn.ModuleList(_BareLoraBlock(32, 64) for _ in range(blocks))
        self.mode = mode

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(x)
        if self.mode == "reentrant":
            # The reentrant checkpoint passes gradients only to inputs that require them
            # (PyTorch's documented limitation).
            h = h.detach().requires_grad_()
        for b in self.blocks:
            h = b(h) if self.mode is None else checkpoint(b, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


@pytest.mark.parametrize("mode", [None, "non_reentrant", "reentrant"])
def test_frozen_weights_inside_default_blocks_train_as_torch(mode):
    """Frozen Linear weights beside trainable adapters inside the default blocks
    (no blocks=). The adapters' gradients all arrive before autograd has used the frozen
    weight for the block input's gradient: the block's backward ends when its inputs'
    gradients are computed too (the crash was "setStorage: ... out of bounds for storage of
    size 0"). With and without torch.utils.checkpoint; the frozen base is partitioned in
    each block's frozen group and released block by block in the backward."""
    torch.manual_seed(3)
    ref = _CheckpointedLoraNet(mode)
    torch.manual_seed(3)
    model = _CheckpointedLoraNet(mode)
    cfg = toy_model.config(4, 1)
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    engine, *_ = strata.initialize(model=model, config=cfg)
    names = [g["name"] for g in engine.groups()]
    assert names == ["root", "emb", "blocks.0", "blocks.1", "blocks.2", "head", "emb:frozen"] + [
        f"blocks.{k}:frozen" for k in range(3)
    ], names
    frozen_numel = {g["name"]: g["numel"] for g in engine.groups() if g["name"].endswith(":frozen")}
    assert frozen_numel["blocks.0:frozen"] == sum(
        p.numel() for p in ref.blocks[0].parameters() if not p.requires_grad
    )
    # When block 0's adapter gradient is computed, the later blocks' frozen bases are
    # released (each at the end of its own backward, not at the end of the backward).
    seen = []
    model.blocks[0].fc1.lora_a.register_hook(
        lambda grad: seen.append([model.blocks[k].fc1.base.weight.numel() for k in (1, 2)])
    )
    trainable = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    _train_lora_as_torch(engine, ref, opt)
    assert seen == [[0, 0]] * 4, seen
    params = engine.gather_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    engine.close()


def test_initialize_copies_no_parameter_of_a_cpu_model():
    """strata.initialize reads a CPU model's parameters in place (fp32, bf16 or
    fp16; the core converts) instead of making an fp32 copy of all of them first. A frozen
    96 MiB bf16 base raises the process's peak by its working shards (96 MiB) and little
    more; the fp32 copy (192 MiB) would add twice the model again (measured 1.06x against
    3.07x with the copy forced)."""
    import json
    import subprocess

    # The plain engine: the test modes (a relocating store copies chunks, the delaying
    # device) measure themselves, not initialize.
    env = {k: v for k, v in os.environ.items() if k not in ("STRATA_TEST_RELOCATING_STORE", "STRATA_CPU_DEVICE_DELAY_SEED")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).parent / "init_memory_worker.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grew = r["after_peak"] - r["before_peak"]
    assert grew <= 1.5 * r["model"], f"initialize raised the peak by {grew / 2**20:.1f} MiB for a {r['model'] / 2**20:.0f} MiB model"


def test_steps_per_print_logs_deepspeeds_progress_line_on_rank_0():
    """Every steps_per_print optimizer steps rank 0 logs DeepSpeed's progress line
    through the "strata" logger (a handler to stderr at INFO by default); setting the
    logger's level quiets it."""
    import logging

    from log_lines import LogLines

    cfg = toy_model.config(GLOBAL_BATCH, 1)
    cfg.update(train_micro_batch_size_per_gpu=GLOBAL_BATCH // 2, gradient_accumulation_steps=2, steps_per_print=2)
    engine, *_ = strata.initialize(model=toy_model.make_model(), config=cfg)
    try:
        with LogLines() as lines:
            for x, y in toy_model.batches(8, GLOBAL_BATCH // 2):  # 4 optimizer steps
                engine.backward(toy_model.loss_fn(engine(x), y))
                engine.step()
            assert [l.split(", lr=")[0] for l in lines.lines] == [
                "[Rank 0] step=2, skipped=0", "[Rank 0] step=4, skipped=0"
            ], lines.lines
            assert "mom=[(0.9, 0.999)]" in lines.lines[0]
            logging.getLogger("strata").setLevel(logging.WARNING)
            for x, y in toy_model.batches(4, GLOBAL_BATCH // 2):
                engine.backward(toy_model.loss_fn(engine(x), y))
                engine.step()
            assert len(lines.lines) == 2, lines.lines
    finally:
        engine.close()


def test_the_engines_phases_are_named_ranges_in_torch_profiler():
    """Under torch.profiler the engine's phases and
    each block's forward are ranges named "strata::" plus the name Strata's own trace gives
    them; a forward that raises leaves no range open; without the profiler none is made."""
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    engine, *_ = strata.initialize(model=toy_model.make_model(), config=cfg)
    block_names = [g["name"] for g in engine.groups()][1:]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for x, y in toy_model.batches(2, GLOBAL_BATCH):
            engine.backward(toy_model.loss_fn(engine(x), y))
            engine.step()
        with torch.no_grad():
            engine(x)
    counts = collections.Counter(e.name for e in prof.events() if e.name.startswith("strata::"))
    assert counts["strata::forward"] == 2 and counts["strata::backward"] == 2 and counts["strata::step"] == 2, counts
    assert counts["strata::forward (no backward)"] == 1, counts
    for name in block_names:
        assert counts[f"strata::forward {name}"] == 3, (name, counts)
    assert not engine._ranges
    # A forward that raises inside a block (an index past the embedding's rows) closes the
    # ranges it opened; training goes on.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(IndexError):
            engine(torch.full((2, toy_model.SEQ), toy_model.VOCAB + 5))
        assert not engine._ranges
        engine.backward(toy_model.loss_fn(engine(x), y))
        engine.step()
    engine.close()


def test_the_engines_waits_are_ranges_in_torch_profiler_named_as_in_its_timeline():
    """The waits of the engine's thread (all-gathers, reductions, the CPU update)
    are torch.profiler ranges named "strata::" plus the span's name in Strata's timeline: over
    two steps, one range per wait span the timeline recorded, name for name."""
    cfg = toy_model.config(GLOBAL_BATCH, 1)
    engine, *_ = strata.initialize(model=toy_model.make_model(), config=cfg)
    try:
        for x, y in toy_model.batches(1, GLOBAL_BATCH):  # warm: the first step records the trace
            engine.backward(toy_model.loss_fn(engine(x), y))
            engine.step()
        engine.timeline()
        engine.enable_timeline()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for x, y in toy_model.batches(2, GLOBAL_BATCH):
                engine.backward(toy_model.loss_fn(engine(x), y))
                engine.step()
        waits = collections.Counter(e["name"] for e in engine.timeline() if e["lane"] == "wait")
        ranges = collections.Counter(e.name[len("strata::"):] for e in prof.events()
                                     if e.name.startswith("strata::") and e.name[len("strata::"):] in waits)
        assert waits and ranges == waits, (ranges, waits)
        assert {"all-gather wait", "step wait"} <= set(waits), waits
        # Outside the profiler no range is opened (and nothing is kept).
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof2:
            pass
        assert not [e for e in prof2.events() if e.name.startswith("strata::")]
    finally:
        engine.close()
