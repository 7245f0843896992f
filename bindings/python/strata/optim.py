"""strata.optim: optimizers over CPU tensors using Strata's SIMD kernels.

``CPUAdam`` is a drop-in ``torch.optim.Optimizer`` (Adam or AdamW) whose update runs in
the fused SIMD kernel of ``optim/cpu_adam`` (AVX-512, AVX2 or scalar, chosen at run time;
the same numbers as ``torch.optim.Adam``/``AdamW`` up to float rounding).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

from . import _strata

__all__ = ["CPUAdam"]

_GRAD_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _check_tensor(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"strata.optim.CPUAdam: {what} is on {t.device}; CPUAdam needs CPU tensors")
    if t.dtype != torch.float32:
        raise ValueError(
            f"strata.optim.CPUAdam: {what} has dtype {t.dtype}; CPUAdam needs torch.float32 "
            "parameters (keep fp32 master weights on the CPU)"
        )
    if t.is_sparse:
        raise ValueError(f"strata.optim.CPUAdam: {what} is sparse; CPUAdam needs dense tensors")
    if not t.is_contiguous():
        raise ValueError(
            f"strata.optim.CPUAdam: {what} (shape {tuple(t.shape)}, stride {t.stride()}) is not "
            "contiguous; pass contiguous tensors (e.g. call .contiguous() before wrapping them "
            "in nn.Parameter)"
        )


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over contiguous fp32 CPU tensors with Strata's SIMD kernel.

    Arguments as ``torch.optim.Adam``: ``lr``, ``betas``, ``eps``, ``weight_decay``;
    ``adamw_mode=True`` applies decoupled weight decay (``torch.optim.AdamW``), False L2
    weight decay added to the gradient (``torch.optim.Adam``); ``bias_correction`` as
    DeepSpeed's ``DeepSpeedCPUAdam``. ``num_threads``: kernel threads, 0 = every core this
    process may use. State per parameter, as torch's:
    ``step`` (a float tensor), ``exp_avg``, ``exp_avg_sq``; ``state_dict()`` and
    ``load_state_dict()`` are torch's (a state dict of torch.optim.Adam loads too).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        num_threads: int = 0,
        isa: Optional[str] = None,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= betas[0] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if amsgrad:
            raise NotImplementedError("strata.optim.CPUAdam: amsgrad is not implemented")
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adamw_mode=adamw_mode,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                _check_tensor(p, f"parameter {pi} of group {gi}")
        self._kernel = _strata.AdamKernel(num_threads, isa)

    @property
    def isa(self) -> str:
        """The instruction set the kernel runs: "avx512", "avx2" or "scalar"."""
        return self._kernel.isa

    def __setstate__(self, state):
        super().__setstate__(state)
        if not hasattr(self, "_kernel"):
            self._kernel = _strata.AdamKernel(0, None)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                what = f"parameter {pi} of group {gi}"
                _check_tensor(p, what)
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError(
                        f"strata.optim.CPUAdam: {what} has a sparse gradient; use a dense one"
                    )
                if grad.device.type != "cpu" or grad.dtype not in _GRAD_DTYPES:
                    raise ValueError(
                        f"strata.optim.CPUAdam: the gradient of {what} is {grad.dtype} on "
                        f"{grad.device}; it must be a CPU float32, bfloat16 or float16 tensor"
                    )
                if grad.shape != p.shape:
                    raise ValueError(
                        f"strata.optim.CPUAdam: the gradient of {what} has shape "
                        f"{tuple(grad.shape)}, the parameter {tuple(p.shape)}"
                    )
                grad = grad.contiguous()
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    state["exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.contiguous_format
                    )
                for key in ("exp_avg", "exp_avg_sq"):
                    s = state[key]
                    if s.dtype != torch.float32 or s.device.type != "cpu" or not s.is_contiguous():
                        state[key] = s = s.to(device="cpu", dtype=torch.float32).contiguous()
                    if s.numel() != p.numel():
                        raise ValueError(
                            f"strata.optim.CPUAdam: state {key} of {what} has {s.numel()} "
                            f"elements, the parameter {p.numel()}"
                        )
                if torch.is_tensor(state["step"]):
                    state["step"] += 1
                    step = int(state["step"].item())
                else:
                    state["step"] += 1
                    step = int(state["step"])
                if p.numel() == 0:
                    continue
                self._kernel.step(
                    p.data_ptr(),
                    grad.data_ptr(),
                    state["exp_avg"].data_ptr(),
                    state["exp_avg_sq"].data_ptr(),
                    p.numel(),
                    _GRAD_DTYPES[grad.dtype],
                    step,
                    group["lr"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["weight_decay"],
                    bool(group["adamw_mode"]),
                    bool(group["bias_correction"]),
                )
        return loss
