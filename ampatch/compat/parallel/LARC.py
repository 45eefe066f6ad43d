"""`apex.parallel.LARC` under the alias: Apex's layer-wise adaptive rate wrapper around any
torch optimizer. Apex's own LARC was plain PyTorch (no kernel); this one is too, with
foreach norms and no host sync per parameter.

It is a `torch.optim.Optimizer` whose param groups and state are the wrapped optimizer's,
so `amp.initialize` and LR schedulers take it like any optimizer.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ampatch.errors import ConfigTypeError

__all__ = ["LARC"]


class LARC(torch.optim.Optimizer):
    """`LARC(optimizer, trust_coefficient=0.02, clip=True, eps=1e-8)`: before each step every
    gradient is scaled by the local rate `trust_coefficient * |p| / (|g| + weight_decay * |p| + eps)`,
    clipped to the group's lr when `clip=True`; the wrapped optimizer's weight decay is folded in."""

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.02, clip: bool = True,
                 eps: float = 1e-8) -> None:  # no Optimizer.__init__: groups and state are the wrapped one's
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigTypeError(f"LARC wraps a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optim.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optim.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optim.defaults

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"LARC({self.optim!r}, trust_coefficient={self.trust_coefficient}, clip={self.clip})"

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """The wrapped optimizer's zero_grad, called as this one was (Apex's fused optimizers take no argument)."""
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optim.add_param_group(param_group)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                wd = group.get("weight_decay", 0)
                decays.append(wd)
                group["weight_decay"] = 0  # folded into the gradient below
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                p_norms = torch._foreach_norm(params)
                g_norms = torch._foreach_norm([p.grad for p in params])
                for p, pn, gn in zip(params, p_norms, g_norms):
                    rate = self.trust_coefficient * pn / (gn + pn * wd + self.eps)
                    if self.clip:
                        rate = torch.clamp(rate / group["lr"], max=1.0)
                    scaled = (p.grad + wd * p) * rate.to(p.grad.dtype)
                    p.grad.copy_(torch.where((pn != 0) & (gn != 0), scaled, p.grad))
        try:
            return self.optim.step() if closure is None else self.optim.step(closure)
        finally:
            for group, wd in zip(self.optim.param_groups, decays):
                group["weight_decay"] = wd
