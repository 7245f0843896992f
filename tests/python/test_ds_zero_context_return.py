"""DeepSpeed's tests/unit/runtime/zero/test_zero_context_return.py, ported (its scenarios and
assertions; harness, names and the dtype Strata's: fp32 on the CPU), 1 rank as DeepSpeed's.

- TestReturnParam::test_ext_param_return: a module returns its own bias and the parent adds
  it after the module's forward ended. Before this port the parent met an empty tensor
  ("The size of tensor a (16) must match the size of tensor b (0)"); the engine now hands
  out a copy made while the bias is whole, and training matches torch's Adam. Internal:
  DeepSpeed's asserts on ``_external_params`` and ``ds_status`` (its bookkeeping of
  parameters registered as external) have no Strata counterpart.
- TestReturnParam::test_ext_param_returnobj: skipped in DeepSpeed itself ("WIP"); the same
  through an object pytree cannot see into is not handled by Strata either (listed).
- TestReturnParam::test_stage_3_output_type[tensor, dict, None]: a forward returning a
  tensor, a dict or None.
Each runs with the default blocks and with the returning module as its own block.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import strata  # noqa: E402

DIM = 16
CONFIG = {
    "train_batch_size": 1,
    "steps_per_print": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1},
}


class DanglingBias(torch.nn.Linear):
    def forward(self, *inputs):
        out = super().forward(*inputs)
        return out, self.bias  # the bias, for the parent to use after this forward


class DanglingAttention(torch.nn.Linear):
    def __init__(self, dim=DIM):
        super().__init__(dim, dim)
        self.d_linear = DanglingBias(dim, dim)

    def forward(self, x):
        out, bias = self.d_linear(super().forward(x))
        return out, bias


class ModelContainer(torch.nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.linear1 = torch.nn.Linear(dim, dim)
        self.dangler = DanglingAttention(dim)

    def forward(self, x):
        act2, bias = self.dangler(self.linear1(x))
        return (act2 + bias).sum()


class DanglingExt(torch.nn.Module):
    def __init__(self, dim=DIM):
        super().__init__()
        self.container = ModelContainer(dim)

    def forward(self, x):
        return self.container(x)


class VariableOutput(torch.nn.Module):
    def __init__(self, output_type, dim=DIM):
        super().__init__()
        self.output_type = output_type
        self.linear1 = torch.nn.Linear(dim, dim)

    def forward(self, x):
        act1 = self.linear1(x)
        if self.output_type == "dict":
            return {"loss": act1.sum()}
        if self.output_type == "tensor":
            return act1.sum()
        return None


def inputs(n):
    g = torch.Generator().manual_seed(2)
    return [torch.rand(DIM, generator=g) for _ in range(n)]


@pytest.mark.parametrize("blocks", ["default", "d_linear", "dangler"])
def test_ext_param_return(blocks):
    torch.manual_seed(0)
    net = DanglingExt()
    torch.manual_seed(0)
    ref = DanglingExt()
    chosen = {"default": None, "d_linear": [net.container.dangler.d_linear], "dangler": [net.container.dangler]}
    engine, *_ = strata.initialize(model=net, model_parameters=net.parameters(), config=CONFIG,
                                   blocks=chosen[blocks])
    opt = torch.optim.Adam(ref.parameters(), lr=0.00015)
    for x in inputs(5):
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        want = ref(x)
        opt.zero_grad()
        want.backward()
        opt.step()
        assert abs(loss.item() - want.item()) <= 1e-5 * max(abs(want.item()), 1e-3), (loss.item(), want.item())
    got = engine.gather_parameters()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
    engine.close()


@pytest.mark.parametrize("output_type", ["tensor", "dict", None])
def test_stage_3_output_type(output_type):
    net = VariableOutput(output_type)
    engine, *_ = strata.initialize(model=net, model_parameters=net.parameters(), config=CONFIG)
    for x in inputs(1):
        loss = engine(x)
        if loss is not None:
            if isinstance(loss, dict):
                loss = loss["loss"]
            engine.backward(loss)
            engine.step()
    assert (loss is None) == (output_type is None)
    engine.close()
