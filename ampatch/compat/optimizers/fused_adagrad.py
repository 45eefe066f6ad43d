"""`apex.optimizers.FusedAdagrad` with Apex's math, on the `amp_C` stand-in `multi_tensor_adagrad`."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..extensions import optim_kernels as K
from .base import ApexOptimizer, closure_loss, grads_of

__all__ = ["FusedAdagrad"]


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
        loss = closure_loss(closure)
        for group in self.param_groups:
            for params in self.by_dtype(group, "FusedAdagrad").values():
                sums = [self.state[p].setdefault("sum", torch.zeros_like(p)) for p in params]
                K.multi_tensor_adagrad(0, self._dummy_overflow_buf, [grads_of(params), params, sums],
                                       group["lr"], group["eps"], self.adagrad_w_mode, group["weight_decay"])
        return loss

