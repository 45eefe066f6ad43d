"""`apex.optimizers.FusedLAMB` with Apex's math, on the `amp_C`
stand-ins (`multi_tensor_lamb`, `multi_tensor_lamb_mp`).

LAMB, per parameter tensor, after clipping every gradient by the global gradient norm:

    g' = g / max(1, |G| / max_grad_norm)          |G|: the norm of all gradients of all groups
    g' = g' + wd * p                              (adam_w_mode=False)
    m = b1 * m + b3 * g'; v = b2 * v + (1 - b2) * g'^2     b3 = 1 - b1 (1 without grad_averaging)
    u = (m / bc1) / (sqrt(v / bc2) + eps) [+ wd * p with adam_w_mode=True]
    p = p - lr * (|p| / |u|) * u                  the trust ratio, where wd != 0 (or use_nvlamb)
                                                  and both norms are non-zero; else p - lr * u

with `bc = 1 - beta ** step` (1 without `bias_correction`). As in Apex, the update is left in
the gradients after the step.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ...errors import InvalidCallError
from ..extensions import optim_kernels as K
from ..extensions.kernels import multi_tensor_l2norm
from .base import ApexOptimizer, grads_of

__all__ = ["FusedLAMB"]


class FusedLAMB(ApexOptimizer):
    """`apex.optimizers.FusedLAMB(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-6, weight_decay=0.01, amsgrad=False, adam_w_mode=True, grad_averaging=True,
    set_grad_none=True, max_grad_norm=1.0, use_nvlamb=False)`: see the module docstring."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 set_grad_none: bool = True, max_grad_norm: float = 1.0, use_nvlamb: bool = False) -> None:
        if amsgrad:
            raise InvalidCallError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb

    def _moments(self, p: Tensor) -> tuple[Tensor, Tensor]:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"], state["exp_avg_sq"]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One LAMB step for every group; returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        buckets = [self.by_dtype(group, "FusedLAMB") for group in self.param_groups]
        grads = grads_of(p for b in buckets for ps in b.values() for p in ps)
        if not grads:
            return loss
        global_grad_norm = multi_tensor_l2norm(0, self._dummy_overflow_buf, [grads], False)[0]
        max_grad_norm = self.defaults["max_grad_norm"]  # Apex reads the constructor's, not the group's
        for group, bucket in zip(self.param_groups, buckets):
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for params in bucket.values():
                m, v = zip(*(self._moments(p) for p in params))
                K.multi_tensor_lamb(0, self._dummy_overflow_buf, [grads_of(params), params, list(m), list(v)],
                                    group["lr"], beta1, beta2, group["eps"], group["step"],
                                    1 if group["bias_correction"] else 0, group["weight_decay"],
                                    1 if group["grad_averaging"] else 0, self.adam_w_mode, global_grad_norm,
                                    max_grad_norm, self.use_nvlamb)
        return loss
