"""What Apex's fused optimizers share (`apex.optimizers` under the alias): `zero_grad()` per
`set_grad_none`, the flag buffer their kernels take, a group's tensors by dtype, and a
`load_state_dict` that keeps the state's dtypes (Apex keeps FP32 moments, and FP32 master
copies, for half parameters; torch's would cast them to the parameter's dtype)."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ampatch.errors import ConfigTypeError, InvalidCallError

__all__ = ["ApexOptimizer", "params_list", "closure_loss", "grads_of", "HALF_AND_FLOAT"]

# The parameter dtypes Apex's optimizers took (float16, float32), plus bfloat16 (the CPU half).
HALF_AND_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def params_list(params: Iterable[Any]) -> list[Any]:
    """The params argument as a list, each group's params a list (a generator is read once)."""
    if isinstance(params, Tensor):
        raise ConfigTypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                              "but got a Tensor.")
    out = []
    for item in params:
        if isinstance(item, dict):
            group = item["params"]
            item = dict(item, params=[group] if isinstance(group, Tensor) else list(group))
        out.append(item)
    return out


def grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    """The gradients of `params`, chosen for having one (`ApexOptimizer.by_dtype`)."""
    out = []
    for p in params:
        assert p.grad is not None, "the params a step takes are those with a gradient"
        out.append(p.grad)
    return out


class ApexOptimizer(torch.optim.Optimizer):
    """Base of the Fused* optimizers: a `torch.optim.Optimizer` whose state lives in
    `self.state` (so `state_dict()`/`load_state_dict()` round-trip it) and whose math runs on
    the `amp_C` stand-ins."""

    set_grad_none: bool = True

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], set_grad_none: bool) -> None:
        super().__init__(params_list(params), defaults)
        self.set_grad_none = set_grad_none
        first = next((p for g in self.param_groups for p in g["params"]), None)
        # Apex's "skip buffer": the noop flag its kernels take (and some read back)
        self._dummy_overflow_buf = torch.zeros(1, dtype=torch.int, device=first.device if first is not None else None)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Grads to None with `set_grad_none` (Apex's default for most), else zeroed in place."""
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def by_dtype(self, group: dict[str, Any], name: str,
                 dtypes: tuple[torch.dtype, ...] = HALF_AND_FLOAT) -> dict[torch.dtype, list[Tensor]]:
        """The group's params that have a gradient, by dtype (in `dtypes` order); sparse
        gradients and other dtypes raise as in Apex."""
        out: dict[torch.dtype, list[Tensor]] = {d: [] for d in dtypes}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise InvalidCallError(f"{name} does not support sparse gradients, please consider SparseAdam instead")
            if p.dtype not in out:
                names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise InvalidCallError(f"{name} only supports {names} parameters, not {p.dtype}.")
            out[p.dtype].append(p)
        return {d: ps for d, ps in out.items() if ps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's `load_state_dict`, then each floating state tensor back in the dtype it was
        saved in (torch casts them to the parameter's dtype: FP32 moments of a half parameter
        would become half)."""
        super().load_state_dict(state_dict)
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if isinstance(value, Tensor) and value.is_floating_point() and key != "step":
                    self.state[p][key] = value.to(device=p.device, copy=True)


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """What a step's closure returns, computed with gradients enabled (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
