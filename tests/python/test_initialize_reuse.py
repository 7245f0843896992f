"""A failed strata.initialize leaves the model as it found it, and a model another engine
holds (or held) is refused at once, naming the cause (issue 77's bugs: a failure after the
engine took the values left the parameters empty and hooks on the model, and a second
initialize of the same module built an engine of 0-element parameters that failed only at
load_checkpoint). Each case then trains the model as torch AdamW does."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
import reuse_worker  # noqa: E402
import strata  # noqa: E402
import toy_model  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reuse_worker.py")


def reference():
    """The one-process torch AdamW run the retried engine must match."""
    losses, _ = toy_model.reference_losses(
        reuse_worker.STEPS, reuse_worker.GLOBAL_BATCH,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0))
    return losses


def check_losses(per_rank, ref):
    for step, want in enumerate(ref):
        got = sum(r[step] for r in per_rank) / len(per_rank)  # equal slices: the batch's mean
        assert abs(got - want) <= 1e-5 * abs(want), f"step {step}: strata {got} torch AdamW {want}"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("scenario", ["monitor", "injected"])
def test_a_failed_initialize_leaves_the_model_to_train_again(tmp_path, scenario, world):
    port = ranks.free_port()
    results = ranks.run(tmp_path, WORKER, world, args_of=lambda r: [scenario, tmp_path],
                        env_of=lambda r: ranks.torchrun_env(r, world, port))
    for rank, r in enumerate(results):
        assert r["error"], f"rank {rank}: the first initialize did not fail"
        assert r["kept"], f"rank {rank}: the failed initialize changed the model ({r['error']})"
        assert r["hooks"] == 0, f"rank {rank}: {r['hooks']} hooks left on the model"
    if scenario == "monitor":
        assert "csv_monitor" in results[0]["error"], results[0]["error"]
    else:
        assert all("injected" in r["error"] for r in results)
    check_losses([r["losses"] for r in results], reference())


def test_a_model_an_engine_holds_or_held_is_refused_and_destroy_restore_gives_it_back():
    model = toy_model.make_model()
    engine, *_ = strata.initialize(model=model, config=reuse_worker.config(1))
    with pytest.raises(RuntimeError, match="already wrapped by an engine .*parameter emb.weight"):
        strata.initialize(model=model, config=reuse_worker.config(1))
    engine.close()
    with pytest.raises(RuntimeError, match="went with an engine that was closed"):
        strata.initialize(model=model, config=reuse_worker.config(1))

    # destroy(restore=True): the trained values back in the model, and another engine on it
    # goes on as torch AdamW from them.
    model = toy_model.make_model()
    engine, *_ = strata.initialize(model=model, config=reuse_worker.config(1))
    first = toy_model.train_slice(engine, 0, 1, 2, reuse_worker.GLOBAL_BATCH)
    trained = engine.gather_parameters()
    engine.destroy(restore=True)
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    engine, *_ = strata.initialize(model=model, config=reuse_worker.config(1))
    second = toy_model.train_slice(engine, 0, 1, 1, reuse_worker.GLOBAL_BATCH)
    engine.close()
    ref = toy_model.make_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    want = []
    for x, y in toy_model.batches(2, reuse_worker.GLOBAL_BATCH):
        loss = toy_model.loss_fn(ref(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        want.append(loss.item())
    # A fresh optimizer on the second engine (Adam's moments start again).
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    x, y = next(iter(toy_model.batches(1, reuse_worker.GLOBAL_BATCH)))
    want.append(toy_model.loss_fn(ref(x), y).item())
    for got, w in zip(first + second, want):
        assert abs(got - w) <= 1e-5 * abs(w), (first + second, want)
