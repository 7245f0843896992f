"""strata.optim.CPUAdam against torch.optim.Adam and AdamW."""

import copy

import pytest

torch = pytest.importorskip("torch")
strata = pytest.importorskip("strata", reason="the _strata module is not built (STRATA_PYTHON=OFF)")

SHAPES = [(1,), (7,), (33, 31), (1000,), (40000,)]  # the last spans two kernel tiles


def make_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def run(opt, params, steps, seed=1, lr_change_at=None):
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        if lr_change_at is not None and step == lr_change_at:
            for group in opt.param_groups:
                group["lr"] *= 0.5
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize(
    "adamw_mode,torch_cls,weight_decay",
    [(False, torch.optim.Adam, 0.0), (False, torch.optim.Adam, 0.05), (True, torch.optim.AdamW, 0.05)],
)
def test_matches_torch_over_many_steps(adamw_mode, torch_cls, weight_decay):
    a, b = make_params(), make_params()
    ours = strata.optim.CPUAdam(a, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay, adamw_mode=adamw_mode)
    ref = torch_cls(b, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay)
    run(ours, a, 200, lr_change_at=100)
    run(ref, b, 200, lr_change_at=100)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)
    for p, q in zip(a, b):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][key], ref.state[q][key], rtol=1e-5, atol=1e-7)
        assert float(ours.state[p]["step"]) == 200


def test_state_dict_round_trip():
    a = make_params()
    opt = strata.optim.CPUAdam(a, lr=1e-2, weight_decay=0.01)
    run(opt, a, 10)
    saved_params = [p.detach().clone() for p in a]
    sd = copy.deepcopy(opt.state_dict())
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert sd["param_groups"][0]["adamw_mode"] is True
    run(opt, a, 10, seed=2)

    b = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = strata.optim.CPUAdam(b, lr=123.0)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == 1e-2
    run(opt2, b, 10, seed=2)
    for p, q in zip(a, b):
        assert torch.equal(p.detach(), q.detach())


def test_loads_torch_adam_state_dict():
    a, b = make_params(), make_params()
    ref = torch.optim.Adam(b, lr=1e-2)
    run(ref, b, 5)
    for p, q in zip(a, b):
        p.data.copy_(q.data)
    ours = strata.optim.CPUAdam(a, lr=1e-2, adamw_mode=False)
    # A copy: torch 2.x's load_state_dict keeps the given state tensors themselves, and the
    # reference goes on updating its own in place.
    sd = copy.deepcopy(ref.state_dict())
    sd["param_groups"][0].update(adamw_mode=False, bias_correction=True)
    ours.load_state_dict(sd)
    run(ours, a, 5, seed=3)
    run(ref, b, 5, seed=3)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7)


def test_errors():
    with pytest.raises(ValueError, match="not contiguous"):
        strata.optim.CPUAdam([torch.nn.Parameter(torch.randn(4, 3).t())])
    with pytest.raises(ValueError, match="dtype torch.float64"):
        strata.optim.CPUAdam([torch.nn.Parameter(torch.randn(4, dtype=torch.float64))])
    with pytest.raises(ValueError, match="is on meta"):
        strata.optim.CPUAdam([torch.nn.Parameter(torch.empty(4, device="meta"))])
    with pytest.raises(ValueError, match="Invalid beta"):
        strata.optim.CPUAdam([torch.nn.Parameter(torch.randn(4))], betas=(1.0, 0.9))
    p = torch.nn.Parameter(torch.randn(4))
    opt = strata.optim.CPUAdam([p])
    p.grad = torch.randn(4).to_sparse()
    with pytest.raises(RuntimeError, match="parameter 0 of group 0 has a sparse gradient"):
        opt.step()
    # A parameter that became non-contiguous after construction is refused at step().
    p.data = torch.randn(4, 2).t()
    p.grad = torch.randn(2, 4)
    with pytest.raises(ValueError, match="not contiguous"):
        opt.step()


def test_closure_and_no_grad_params():
    p = torch.nn.Parameter(torch.ones(3))
    q = torch.nn.Parameter(torch.ones(3))
    opt = strata.optim.CPUAdam([p, q], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p * 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 6.0
    assert torch.all(p < 1) and torch.equal(q.detach(), torch.ones(3))
    assert opt.isa in ("scalar", "avx2", "avx512")


def test_kernel_scaling_copy_out_and_norm_pass():
    """The raw kernel's fused unscale/clip and bf16 copy-out (what bench/peers times): the
    same parameters as an unscaled gradient through a plain step, and the copy-out equal
    to the parameters rounded to bf16; the norm pass equals torch's sum of squares."""
    from strata import _strata

    n = 100003
    g = torch.Generator().manual_seed(4)
    p_a = torch.randn(n, generator=g)
    p_b = p_a.clone()
    grad16 = (torch.randn(n, generator=g) * 256).to(torch.bfloat16)
    plain_grad = (grad16.float() * (0.5 / 256)).contiguous()  # exact: powers of two
    m_a, v_a, m_b, v_b = (torch.zeros(n) for _ in range(4))
    out = torch.zeros(n, dtype=torch.bfloat16)
    k = _strata.AdamKernel(1)
    hp = (1e-3, 0.9, 0.999, 1e-8, 0.01, True, True)
    k.step(p_a.data_ptr(), grad16.data_ptr(), m_a.data_ptr(), v_a.data_ptr(), n, "bf16", 1, *hp,
           inv_loss_scale=1.0 / 256, clip_coef=0.5, param16=out.data_ptr(), param16_dtype="bf16")
    k.step(p_b.data_ptr(), plain_grad.data_ptr(), m_b.data_ptr(), v_b.data_ptr(), n, "fp32", 1, *hp)
    assert torch.equal(p_a, p_b) and torch.equal(m_a, m_b) and torch.equal(v_a, v_b)
    assert torch.equal(out, p_a.to(torch.bfloat16))
    sum_sq, bad = k.grad_squared_norm(grad16.data_ptr(), n, "bf16", 1.0 / 256)
    assert not bad
    assert sum_sq == pytest.approx(float((grad16.double() / 256).pow(2).sum()), rel=1e-12)
    grad16[17] = float("inf")
    assert k.grad_squared_norm(grad16.data_ptr(), n, "bf16")[1]
    with pytest.raises(ValueError, match="param16_dtype must be bf16 or fp16"):
        k.step(p_a.data_ptr(), plain_grad.data_ptr(), m_a.data_ptr(), v_a.data_ptr(), n, "fp32", 2,
               *hp, param16=out.data_ptr(), param16_dtype="fp32")


def test_lr_schedule_of_a_config():
    """_strata.lr_schedule: the rates the engine uses (DeepSpeed's timing: step 0 the
    constructor's rate, step i the formula at i - 1), and OneCycle's betas."""
    import json

    from strata import _strata

    cfg = {"train_batch_size": 1, "optimizer": {"params": {"lr": 1e-3}},
           "scheduler": {"type": "WarmupLR",
                         "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 4,
                                    "warmup_type": "linear"}}}
    lrs = [lr for lr, _, _ in _strata.lr_schedule(json.dumps(cfg), 7)]
    assert lrs == pytest.approx([0.0, 0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    cfg["scheduler"] = {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3,
                                                       "cycle_first_step_size": 2}}
    steps = _strata.lr_schedule(json.dumps(cfg), 3)
    # Step 0: the constructor's cycle_min_lr and cycle_min_mom (as DeepSpeed); then the lr
    # rises and beta1 moves inside [cycle_min_mom, cycle_max_mom]; beta2 is 0.99 as
    # DeepSpeed sets it (bench/peers/schedules_vs_deepspeed.py checks every value).
    assert steps[0] == pytest.approx((1e-4, 0.8, 0.99))
    assert steps[0][0] < steps[1][0] < steps[2][0]
    assert all(0.8 <= b1 <= 0.9 and b2 == 0.99 for _, b1, b2 in steps)
    with pytest.raises(ValueError, match="scheduler.type"):
        _strata.lr_schedule(json.dumps({"train_batch_size": 1, "scheduler": {"type": "Nope"}}), 1)
