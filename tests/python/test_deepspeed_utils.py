"""DeepSpeed's helpers a script calls beside the engine (issue 77's "Missing API"), on one
rank: strata.zero.register_external_parameter (and the note a forward's error gets when a
parameter is used outside its module), strata.utils' fp32 accessors,
strata.utils.zero_to_fp32 on a checkpoint, and strata.comm. None of these existed before."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402
import strata.comm  # noqa: E402
import strata.utils  # noqa: E402
import toy_model  # noqa: E402
from strata.utils import zero_to_fp32  # noqa: E402


class Outside(torch.nn.Module):
    """DeepSpeed's test_zero.py scenario: the parent's forward uses linear1's weight
    directly; linear1 and linear2 are blocks (groups of their own)."""

    def __init__(self, register=False):
        super().__init__()
        self.linear1 = torch.nn.Linear(8, 8)
        self.linear2 = torch.nn.Linear(8, 8)
        if register:
            strata.zero.register_external_parameter(self, self.linear1.weight)

    def forward(self, x):
        h = self.linear2(torch.relu(self.linear1(x)))
        return F.linear(h, self.linear1.weight)  # outside linear1's forward


def cfg():
    return {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3}}


def data(steps):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(steps)]


def test_a_parameter_used_outside_its_module_is_named_and_registering_it_trains_as_torch():
    torch.manual_seed(0)
    m = Outside()
    engine, *_ = strata.initialize(model=m, config=cfg(), blocks=[m.linear1, m.linear2])
    x, _ = data(1)[0]
    with pytest.raises(RuntimeError) as err:
        engine(x)
    notes = "\n".join(getattr(err.value, "__notes__", []))
    assert "linear1.weight" in notes and "register_external_parameter" in notes, notes
    engine.close()

    torch.manual_seed(0)
    ref = Outside()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    torch.manual_seed(0)
    m = Outside(register=True)
    engine, *_ = strata.initialize(model=m, config=cfg(), blocks=[m.linear1, m.linear2])
    groups = {g["name"]: [name for name, _, _ in g["params"]] for g in engine.groups()}
    assert groups["root"] == ["linear1.weight"] and groups["linear1"] == ["linear1.bias"], groups
    for x, y in data(3):
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        want = F.mse_loss(ref(x), y)
        opt.zero_grad()
        want.backward()
        opt.step()
        assert abs(loss.item() - want.item()) <= 1e-5 * abs(want.item())
    # After initialize: a parameter in a block's group cannot move; one in the root is there.
    with pytest.raises(RuntimeError, match="register it before strata.initialize"):
        strata.zero.register_external_parameter(m, m.linear2.weight)
    strata.zero.register_external_parameter(m, m.linear1.weight)
    engine.close()


def test_safe_get_and_set_full_fp32_param():
    m = toy_model.make_model()
    engine, *_ = strata.initialize(model=m, config=toy_model.config(4, 1))
    toy_model.train_slice(engine, 0, 1, 2, 4)
    whole = engine.gather_parameters()
    got = strata.utils.safe_get_full_fp32_param(m.head.weight)
    assert got.dtype == torch.float32 and torch.equal(got, whole["head.weight"])
    value = torch.randn(whole["head.weight"].shape)
    strata.utils.safe_set_full_fp32_param(m.head.weight, value)
    assert torch.equal(engine.gather_parameters()["head.weight"], value)
    assert torch.equal(engine.gather_parameters()["head.bias"], whole["head.bias"])
    with pytest.raises(ValueError, match="value has shape"):
        strata.utils.safe_set_full_fp32_param(m.head.weight, torch.zeros(3))
    assert strata.utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2))) is None
    with pytest.raises(NotImplementedError, match="safe_get_full_grad: the gradient"):
        strata.utils.safe_get_full_grad(m.head.weight)
    engine.close()


def test_zero_to_fp32_reads_the_checkpoints_fp32_model(tmp_path):
    m = toy_model.make_model()
    engine, *_ = strata.initialize(model=m, config=toy_model.config(4, 1))
    toy_model.train_slice(engine, 0, 1, 2, 4)
    engine.save_checkpoint(tmp_path / "ckpt")
    whole = engine.gather_parameters()
    engine.close()
    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert sorted(state) == sorted(whole)
    assert all(torch.equal(state[n], whole[n]) for n in whole)
    fresh = zero_to_fp32.load_state_dict_from_zero_checkpoint(toy_model.make_model(seed=7), tmp_path / "ckpt")
    assert all(torch.equal(p, whole[n]) for n, p in fresh.named_parameters())
    # As a script, DeepSpeed's zero_to_fp32.py's arguments.
    done = subprocess.run([sys.executable, "-m", "strata.utils.zero_to_fp32", str(tmp_path / "ckpt"),
                           str(tmp_path / "out")], capture_output=True, text=True, env={**os.environ,
                           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert all(torch.equal(written[n], whole[n]) for n in whole)
    with pytest.raises(RuntimeError, match="strata-ckpt export"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(tmp_path / "nothing")


def test_comm_answers_from_the_environment_and_from_a_process_group():
    assert not strata.comm.is_initialized()
    assert (strata.comm.get_rank(), strata.comm.get_world_size()) == (0, 1)
    t = torch.ones(3)
    strata.comm.all_reduce(t)  # one process: nothing to do
    strata.comm.barrier()
    assert torch.equal(t, torch.ones(3))
    strata.comm.init_distributed(dist_backend="gloo")
    try:
        assert strata.comm.is_initialized() and strata.comm.get_world_size() == 1
        strata.comm.all_reduce(t)
        assert torch.equal(t, torch.ones(3))
    finally:
        torch.distributed.destroy_process_group()
    os.environ["WORLD_SIZE"] = "2"
    try:
        with pytest.raises(RuntimeError, match="call strata.comm.init_distributed"):
            strata.comm.all_reduce(t)
    finally:
        del os.environ["WORLD_SIZE"]
