"""`apex.optimizers.FusedMixedPrecisionLamb`: LAMB (see `fused_lamb`) with tensor `lr`/`step`,
`step(grad_scaler=...)`, and FP32 master copies for reduced-precision parameters, on the
`amp_C` stand-in `multi_tensor_lamb_mp`."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ...errors import InvalidCallError
from ..extensions import optim_kernels as K
from ..extensions.kernels import multi_tensor_l2norm_mp
from .base import ApexOptimizer, grads_of

__all__ = ["FusedMixedPrecisionLamb"]


class FusedMixedPrecisionLamb(ApexOptimizer):
    """`apex.optimizers.FusedMixedPrecisionLamb(params, lr=1e-3, step=0, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, amsgrad=False, adam_w_mode=True,
    grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False, reduced_precision_dtype=None)`:
    LAMB with `lr` and `step` as tensors, `step(grad_scaler=...)` for `torch.amp.GradScaler`
    (unscales inside the step, skips overflowed steps), and for parameters of
    `reduced_precision_dtype` FP32 master copies (made at the first step, kept in the optimizer
    state) that the step runs on."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, step: int = 0, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01,
                 amsgrad: bool = False, adam_w_mode: bool = True, grad_averaging: bool = True,
                 max_grad_norm: float = 1.0, use_nvlamb: bool = False,
                 reduced_precision_dtype: torch.dtype | None = None) -> None:
        if amsgrad:
            raise InvalidCallError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(lr=torch.tensor(lr, dtype=torch.float32), step=torch.tensor([step], dtype=torch.int),
                        bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults, set_grad_none=True)
        device = self.param_groups[0]["params"][0].device
        for group in self.param_groups:
            for item in ("lr", "step"):
                group[item] = group[item].to(device=device)
        self.reduced_precision_dtype = reduced_precision_dtype
        self._step_supports_amp_scaling = True
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.use_nvlamb = use_nvlamb

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's, with each tensor default copied (two groups must not share one `lr` tensor)."""
        super().add_param_group(param_group)
        for name, default in self.defaults.items():
            if isinstance(default, Tensor) and name not in param_group:
                self.param_groups[-1][name] = default.clone()

    @property
    def param_groups_full_precision(self) -> list[dict[str, list[Tensor | None]]]:
        """Apex's name for the FP32 master copies, group by group (None for a parameter without one)."""
        return [{"params": [self.state[p].get("master_param") for p in g["params"]]} for g in self.param_groups]

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        state = self.state[p]
        reduced = self.reduced_precision_dtype is not None and p.dtype == self.reduced_precision_dtype
        if "exp_avg" not in state:
            dtype = torch.float32 if reduced else p.dtype
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        if reduced and "master_param" not in state:
            state["master_param"] = p.detach().clone().float()
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None) -> Any:
        """One step for every group; with `grad_scaler`, unscales and skips an overflowed step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != group["params"][0].dtype:
                    raise InvalidCallError(f"Error: Parameters are not of the identical type: "
                                           f"{group['params'][0].dtype} != {p.dtype}")
                if p.grad is not None:
                    grads.append(p.grad)
        if not grads:
            return loss
        device = self.param_groups[0]["params"][0].device
        found_inf = (grad_scaler._check_inf_per_device(self)[device] if grad_scaler is not None
                     else torch.zeros(1, dtype=torch.float32, device=device))
        self._dummy_overflow_buf.copy_(found_inf.reshape(-1)[:1])
        scale = (grad_scaler._get_scale_async() if grad_scaler is not None
                 else torch.ones(1, dtype=torch.float32, device=device))
        inv_scale = scale.double().reciprocal().float()
        max_grad_norm = self.defaults["max_grad_norm"] * scale  # the norm below is of scaled gradients
        grad_norm = multi_tensor_l2norm_mp(0, self._dummy_overflow_buf, [grads], False)[0]
        for group in self.param_groups:
            group["step"] += (self._dummy_overflow_buf != 1).to(torch.int)
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            states = [self._state(p) for p in params]
            lists = [grads_of(params), [s.get("master_param", p) for s, p in zip(states, params)],
                     [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]]
            if self.reduced_precision_dtype is not None:
                lists.append(params)
            K.multi_tensor_lamb_mp(0, self._dummy_overflow_buf, lists, group["lr"], beta1, beta2, group["eps"],
                                   group["step"], 1 if group["bias_correction"] else 0, group["weight_decay"],
                                   1 if group["grad_averaging"] else 0, self.adam_w_mode, grad_norm, max_grad_norm,
                                   self.use_nvlamb, found_inf, inv_scale)
        return loss
