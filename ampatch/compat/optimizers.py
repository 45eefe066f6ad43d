"""`apex.optimizers` under the alias: Apex's fused optimizers with Apex's math, arguments and
defaults, computed by the `amp_C` stand-ins on torch's foreach ops (any device).

`FusedAdam` lives in `adam`, `FusedLAMB` and `FusedMixedPrecisionLamb` in `lamb`,
`FP16_Optimizer` (Apex's wrapper for the pre-2019 FusedAdam) in `fused_fp16_optimizer`;
`FusedSGD`, `FusedAdagrad` and `FusedNovoGrad` here. Each keeps its state in `optimizer.state` (and, as in
Apex, `step` in the param group), so `state_dict()`/`load_state_dict()` round-trip it, and each
works under `amp.initialize` at every level (at O2 the FP32 masters are the params it sees).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import required  # type: ignore[attr-defined]

from . import optim_kernels as K
from .adam import FusedAdam
from .fused_fp16_optimizer import FP16_Optimizer
from .kernels import norms
from .lamb import FusedLAMB, FusedMixedPrecisionLamb
from .optim_base import ApexOptimizer

logger = logging.getLogger("ampatch")

__all__ = ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad",
           "FP16_Optimizer"]


def _closure_loss(closure: Callable[[], Any] | None) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class FusedSGD(ApexOptimizer):
    """`apex.optimizers.FusedSGD(params, lr=required, momentum=0, dampening=0, weight_decay=0,
    nesterov=False, wd_after_momentum=False, materialize_master_grads=True, set_grad_none=False)`:

        d = g + wd * p                       (weight decay before momentum, the default)
        buf = d (first step), else momentum * buf + (1 - dampening) * d
        d = d + momentum * buf (nesterov), else buf
        d = d + wd * p                       (wd_after_momentum=True instead of the first line)
        p = p - lr * d

    `lr` may be left out when every param group sets its own, as in Apex; `zero_grad()`
    zeroes in place (`set_grad_none=False`)."""

    def __init__(self, params: Iterable[Any], lr: float = required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False) -> None:
        if lr is not required and lr < 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, set_grad_none)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        if not materialize_master_grads:
            logger.info("ampatch: FusedSGD(materialize_master_grads=False) only changed where Apex kept O2 master "
                        "gradients; ampatch always keeps them on the FP32 masters (same result). Ignored.")
        self.most_recent_scale = 1.0  # Apex's amp set these for its own O2 path; the step divides by the scale
        self.scale_set_by_backward = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One SGD step for every group; returns the closure's loss."""
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for params in self.by_dtype(group, "FusedSGD").values():
                fresh = [p for p in params if "momentum_buffer" not in self.state[p]]
                kept = [p for p in params if "momentum_buffer" in self.state[p]]
                for first_run, chosen in ((True, fresh), (False, kept)):  # a new buffer starts as the gradient
                    if not chosen:
                        continue
                    moms = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in chosen]
                    K.multi_tensor_sgd(0, self._dummy_overflow_buf, [[p.grad for p in chosen], chosen, moms],
                                       group["weight_decay"], group["momentum"], group["dampening"], group["lr"],
                                       group["nesterov"], first_run, self.wd_after_momentum,
                                       1.0 / self.most_recent_scale)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss


class FusedAdagrad(ApexOptimizer):
    """`apex.optimizers.FusedAdagrad(params, lr=1e-2, eps=1e-10, weight_decay=0.0,
    set_grad_none=True, adagrad_w_mode=False)`:

        g' = g + wd * p                      (adagrad_w_mode=False: L2)
        h = h + g'^2
        p = p - lr * (g' / (sqrt(h) + eps) [+ wd * p with adagrad_w_mode=True])
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False) -> None:
        super().__init__(params, dict(lr=lr, eps=eps, weight_decay=weight_decay), set_grad_none)
        self.adagrad_w_mode = 1 if adagrad_w_mode else 0

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adagrad step for every group; returns the closure's loss."""
        loss = _closure_loss(closure)
        for group in self.param_groups:
            for params in self.by_dtype(group, "FusedAdagrad").values():
                sums = [self.state[p].setdefault("sum", torch.zeros_like(p)) for p in params]
                K.multi_tensor_adagrad(0, self._dummy_overflow_buf, [[p.grad for p in params], params, sums],
                                       group["lr"], group["eps"], self.adagrad_w_mode, group["weight_decay"])
        return loss


# Apex's FusedNovoGrad keeps one tensor of per-parameter norms per dtype in the group:
# group["exp_avg_sq"][i], i by dtype (Apex had float16 and float32; bfloat16 is the third).
_NORM_SLOT = {torch.float16: 0, torch.float32: 1, torch.bfloat16: 2}


class FusedNovoGrad(ApexOptimizer):
    """`apex.optimizers.FusedNovoGrad(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, weight_decay=0.0, amsgrad=False, reg_inside_moment=False, grad_averaging=True,
    norm_type=2, init_zero=False, set_grad_none=True)`, per parameter tensor:

        n = sqrt(b2 * n^2 + (1 - b2) * |g|^2)   (norm_type=2; 0: n = b2 * n + (1 - b2) * max|g|)
                                                n starts at the first step's norm (0 with init_zero)
        d = n / bc2 + eps                       bc2 = sqrt(1 - b2 ** step), bc1 = 1 - b1 ** step
        reg_inside_moment=False: m = b1 * m + b3 * g;  p = p - lr * ((m / bc1) / d + wd * p)
        reg_inside_moment=True:  m = b1 * m + b3 * (g / d + wd * p);  p = p - lr * m / bc1

    with b3 = 1 - b1 (1 without grad_averaging); the norms live in the group (`exp_avg_sq`)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, reg_inside_moment: bool = False, grad_averaging: bool = True,
                 norm_type: int = 2, init_zero: bool = False, set_grad_none: bool = True) -> None:
        if amsgrad:
            raise RuntimeError("FusedNovoGrad does not support the AMSGrad variant.")
        if norm_type not in (0, 2):
            raise RuntimeError("FusedNovoGrad only support l2/inf norm now.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, norm_type=norm_type, init_zero=init_zero)
        super().__init__(params, defaults, set_grad_none)
        self.moment_mode = 0 if reg_inside_moment else 1

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As Apex's: the per-parameter norms move to the parameters' device."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if group["params"] and "exp_avg_sq" in group:
                device = group["params"][0].device
                group["exp_avg_sq"] = [t.to(device) if isinstance(t, Tensor) else t for t in group["exp_avg_sq"]]

    def _norms(self, group: dict[str, Any], dtype: torch.dtype, grads: list[Tensor]) -> Tensor:
        slots = group.setdefault("exp_avg_sq", [None, None])
        slot = _NORM_SLOT[dtype]
        slots.extend([None] * (slot + 1 - len(slots)))
        if slots[slot] is None:
            if group["init_zero"]:
                slots[slot] = torch.zeros(len(grads), device=grads[0].device)
            else:  # the first step's norms, so that the first blend changes nothing
                slots[slot] = norms(grads, float("inf") if group["norm_type"] == 0 else 2.0)
        elif slots[slot].numel() != len(grads):
            raise RuntimeError(f"FusedNovoGrad keeps one norm per parameter with a gradient: {slots[slot].numel()} "
                               f"norms for {len(grads)} gradients of {dtype} in this group (every parameter that "
                               "had a gradient at the first step needs one at every step).")
        return slots[slot]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One NovoGrad step for every group; returns the closure's loss."""
        loss = _closure_loss(closure)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for dtype, params in self.by_dtype(group, "FusedNovoGrad").items():
                grads = [p.grad for p in params]
                moms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
                K.multi_tensor_novograd(0, self._dummy_overflow_buf, [grads, params, moms],
                                        self._norms(group, dtype, grads), group["lr"], beta1, beta2, group["eps"],
                                        group["step"], 1 if group["bias_correction"] else 0, group["weight_decay"],
                                        1 if group["grad_averaging"] else 0, self.moment_mode, group["norm_type"])
        return loss
