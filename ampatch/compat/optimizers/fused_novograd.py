"""`apex.optimizers.FusedNovoGrad` with Apex's math, on the `amp_C` stand-in `multi_tensor_novograd`."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ...errors import InvalidCallError
from ..extensions import optim_kernels as K
from ..extensions.kernels import norms
from .base import ApexOptimizer, closure_loss, grads_of

__all__ = ["FusedNovoGrad"]

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
            raise InvalidCallError("FusedNovoGrad does not support the AMSGrad variant.")
        if norm_type not in (0, 2):
            raise InvalidCallError("FusedNovoGrad only support l2/inf norm now.")
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
                slots[slot] = torch.zeros(len(grads), dtype=torch.float32, device=grads[0].device)
            else:  # the first step's norms, so that the first blend changes nothing
                slots[slot] = norms(grads, float("inf") if group["norm_type"] == 0 else 2.0)
        elif slots[slot].numel() != len(grads):
            raise InvalidCallError(f"FusedNovoGrad keeps one norm per parameter with a gradient: {slots[slot].numel()} "
                                   f"norms for {len(grads)} gradients of {dtype} in this group (every parameter that "
                                   "had a gradient at the first step needs one at every step).")
        return slots[slot]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One NovoGrad step for every group; returns the closure's loss."""
        loss = closure_loss(closure)
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for dtype, params in self.by_dtype(group, "FusedNovoGrad").items():
                grads = grads_of(params)
                moms = [self.state[p].setdefault("exp_avg", torch.zeros_like(p)) for p in params]
                K.multi_tensor_novograd(0, self._dummy_overflow_buf, [grads, params, moms],
                                        self._norms(group, dtype, grads), group["lr"], beta1, beta2, group["eps"],
                                        group["step"], 1 if group["bias_correction"] else 0, group["weight_decay"],
                                        1 if group["grad_averaging"] else 0, self.moment_mode, group["norm_type"])
        return loss
