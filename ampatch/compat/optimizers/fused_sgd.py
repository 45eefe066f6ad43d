"""`apex.optimizers.FusedSGD` with Apex's math, on the `amp_C` stand-in `multi_tensor_sgd`."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import required

from ...errors import ConfigError
from ..extensions import optim_kernels as K
from .base import ApexOptimizer, closure_loss, grads_of

logger = logging.getLogger("ampatch")

__all__ = ["FusedSGD"]


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

    def __init__(self, params: Iterable[Any], lr: Any = required, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False) -> None:
        if lr is not required and lr < 0.0:
            raise ConfigError(f"Invalid learning rate: {lr}")
        if momentum < 0.0:
            raise ConfigError(f"Invalid momentum value: {momentum}")
        if weight_decay < 0.0:
            raise ConfigError(f"Invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ConfigError("Nesterov momentum requires a momentum and zero dampening")
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
        loss = closure_loss(closure)
        for group in self.param_groups:
            for params in self.by_dtype(group, "FusedSGD").values():
                fresh = [p for p in params if "momentum_buffer" not in self.state[p]]
                kept = [p for p in params if "momentum_buffer" in self.state[p]]
                for first_run, chosen in ((True, fresh), (False, kept)):  # a new buffer starts as the gradient
                    if not chosen:
                        continue
                    moms = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in chosen]
                    K.multi_tensor_sgd(0, self._dummy_overflow_buf, [grads_of(chosen), chosen, moms],
                                       group["weight_decay"], group["momentum"], group["dampening"], group["lr"],
                                       group["nesterov"], first_run, self.wd_after_momentum,
                                       1.0 / self.most_recent_scale)
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        return loss

