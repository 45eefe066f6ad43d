"""`apex.optimizers.FusedAdam` with Apex's math, on the `amp_C` stand-ins.

Every argument of Apex's last signature: `bias_correction`, `adam_w_mode` (decoupled weight
decay, the default, or L2), `amsgrad` (raises, as in Apex), `set_grad_none`, `capturable`
(learning rate and step kept as tensors, and `step(grad_scaler=...)` for
`torch.amp.GradScaler`, which then skips overflowed steps), `master_weights` (with
`capturable`, as Apex required: FP32 copies of half parameters that the step runs on, kept in
the optimizer state). The pre-2019 keywords `eps_inside_sqrt` and `max_grad_norm` select that
version's math (`fused_adam_cuda`): see `FusedAdam`.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ...errors import ConfigError, InvalidCallError
from ..extensions import optim_kernels as K
from ..extensions.kernels import norms, store, total_norm, upcast
from .base import HALF_AND_FLOAT, ApexOptimizer, grads_of

__all__ = ["FusedAdam"]

_UPDATED = ("FusedAdam has been updated.  Simply initialize it identically to torch.optim.Adam, and call step() "
            "with no arguments.")
_DTYPES = (*HALF_AND_FLOAT, torch.float64)


class FusedAdam(ApexOptimizer):
    """Adam as Apex computed it:

        g' = g + wd * p                       (adam_w_mode=False: L2)
        m = b1 * m + (1 - b1) * g'; v = b2 * v + (1 - b2) * g'^2
        update = (m / bc1) / (sqrt(v / bc2) + eps) [+ wd * p with adam_w_mode=True]
        p = p - lr * update

    with `bc = 1 - beta ** step` (1 with `bias_correction=False`); moments in FP32 whatever
    the parameter's dtype. The pre-2019 form (`eps_inside_sqrt=`, `max_grad_norm=` given):

        g' = g / scale, divided further by (|g| / scale + 1e-6) / max_grad_norm when that is > 1
        m, v as above (no bias correction in them); denom = sqrt(v + eps) or sqrt(v) + eps
        p = p - lr * sqrt(bc2) / bc1 * (m / denom + wd * p)

    where |g| is the group's gradient norm (`grad_norms` given to `step`, else computed), and
    `step` takes that version's `scale`, `grad_norms`, `grads` and `output_params`.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False, *, eps_inside_sqrt: bool | None = None,
                 max_grad_norm: float | None = None) -> None:
        if amsgrad:
            raise InvalidCallError("FusedAdam does not support the AMSGrad variant.")
        if master_weights and not capturable:
            raise InvalidCallError("Master weights is currently only supported with the capturable version.")
        self.legacy = eps_inside_sqrt is not None or max_grad_norm is not None
        if self.legacy and (capturable or master_weights):
            raise ConfigError("FusedAdam: eps_inside_sqrt/max_grad_norm belong to the pre-2019 FusedAdam, which had "
                              "no capturable or master_weights; drop one or the other.")
        defaults = dict(lr=torch.tensor(lr, dtype=torch.float32) if capturable else lr,
                        bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        if self.legacy:
            defaults["max_grad_norm"] = max_grad_norm or 0.0
        super().__init__(params, defaults, set_grad_none)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.eps_mode = 0 if eps_inside_sqrt else 1  # the pre-2019 name: 0 puts eps under the square root
        self.capturable = capturable
        self.master_weights = master_weights
        if capturable:
            for group in self.param_groups:
                if group["params"]:
                    group["lr"] = group["lr"].to(group["params"][0].device)
            self._step_supports_amp_scaling = True
        if master_weights:
            for group in self.param_groups:
                for p in group["params"]:
                    self.state[p]["master_param"] = p.detach().clone().float()

    @property
    def param_groups_master(self) -> list[dict[str, list[Tensor | None]]]:
        """Apex's name for the FP32 master copies, group by group (None without master weights)."""
        return [{"params": [self.state[p].get("master_param") for p in g["params"]]} for g in self.param_groups]

    def _moments(self, p: Tensor) -> tuple[Tensor, Tensor]:
        state = self.state[p]
        if "exp_avg" not in state:
            dtype = p.dtype if self.legacy else torch.float32
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state["exp_avg"], state["exp_avg_sq"]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None, output_params: Any = None,
             scale: Any = None, grad_norms: Any = None, grad_scaler: Any = None) -> Any:
        """One Adam step for every group (see the class docstring); returns the closure's loss."""
        if not self.legacy and any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise InvalidCallError(_UPDATED)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.legacy:
            self._legacy_step(grads, output_params, 1.0 if scale is None else float(scale), grad_norms)
        elif self.capturable:
            self._capturable_step(grad_scaler)
        else:
            self._plain_step()
        return loss

    def _plain_step(self) -> None:
        for group in self.param_groups:
            if not group["params"]:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            for params in self.by_dtype(group, "FusedAdam", _DTYPES).values():
                m, v = zip(*(self._moments(p) for p in params))
                K.multi_tensor_adam(0, self._dummy_overflow_buf, [grads_of(params), params, list(m),
                                                                  list(v)],
                                    group["lr"], beta1, beta2, group["eps"], group["step"], self.adam_w_mode,
                                    1 if group["bias_correction"] else 0, group["weight_decay"])

    def _capturable_step(self, grad_scaler: Any) -> None:
        for group in self.param_groups:
            if not group["params"]:
                continue
            device = group["params"][0].device
            if grad_scaler is not None:
                found_inf = grad_scaler._check_inf_per_device(self)[device]
                inv_scale = grad_scaler._get_scale_async().double().reciprocal().float()
            else:
                found_inf = torch.zeros(1, dtype=torch.float32, device=device)
                inv_scale = torch.ones(1, dtype=torch.float32, device=device)
            self._dummy_overflow_buf.copy_(found_inf.reshape(-1)[:1])
            clean = (self._dummy_overflow_buf != 1).to(torch.int)
            group["step"] = group["step"] + clean if "step" in group else torch.ones(1, dtype=torch.int,
                                                                                      device=device)
            beta1, beta2 = group["betas"]
            for params in self.by_dtype(group, "FusedAdam", _DTYPES).values():
                m, v = zip(*(self._moments(p) for p in params))
                lists = [grads_of(params), params, list(m), list(v)]
                kernel = K.multi_tensor_adam_capturable
                if self.master_weights and params[0].dtype != torch.bfloat16:  # Apex: no masters for bfloat16
                    lists.append([self.state[p]["master_param"] for p in params])
                    kernel = K.multi_tensor_adam_capturable_master
                kernel(0, self._dummy_overflow_buf, lists, group["lr"], beta1, beta2, group["eps"], group["step"],
                       self.adam_w_mode, 1 if group["bias_correction"] else 0, group["weight_decay"], inv_scale)

    # ---------------------------------------------------------------- the pre-2019 FusedAdam
    def _legacy_step(self, grads: Any, output_params: Any, scale: float, grad_norms: Any) -> None:
        groups = self.param_groups
        grads_group = _per_group(grads, len(groups))
        outputs_group = _per_group(output_params, len(groups))
        norms_group = list(grad_norms) if grad_norms is not None else [None] * len(groups)
        for group, g_given, out_given, grad_norm in zip(groups, grads_group, outputs_group, norms_group):
            g_given = list(g_given) if g_given is not None else [None] * len(group["params"])
            out_given = list(out_given) if out_given is not None else [None] * len(group["params"])
            chosen = [(p, g if g is not None else p.grad, o) for p, g, o in zip(group["params"], g_given, out_given)
                      if g is not None or p.grad is not None]
            if not chosen:
                continue
            if any(g.is_sparse for _, g, _ in chosen):
                raise InvalidCallError("FusedAdam does not support sparse gradients, please consider SparseAdam "
                                       "instead")
            combined = scale
            if group["max_grad_norm"] > 0:
                if grad_norm is None:  # Apex's FP16_Optimizer passed it; compute it when nobody does
                    grad_norm = total_norm(norms([g for _, g, _ in chosen])).item()
                clip = (float(grad_norm) / scale + 1e-6) / group["max_grad_norm"]
                if clip > 1:
                    combined = clip * scale
            self._legacy_update(group, chosen, combined)

    def _legacy_update(self, group: dict[str, Any], chosen: list[tuple[Tensor, Tensor, Any]],
                       combined_scale: float) -> None:
        beta1, beta2 = group["betas"]
        params = [p for p, _, _ in chosen]
        for p in params:
            self._moments(p)
            self.state[p]["step"] = self.state[p].get("step", 0) + 1
        step = self.state[params[0]]["step"]
        bc1, bc2 = (1 - beta1 ** step, 1 - beta2 ** step) if group["bias_correction"] else (1.0, 1.0)
        step_size = group["lr"] * bc2 ** 0.5 / bc1
        m = [self.state[p]["exp_avg"] for p in params]
        v = [self.state[p]["exp_avg_sq"] for p in params]
        p32, m32, v32 = upcast(params), upcast(m), upcast(v)
        g32 = torch._foreach_div(upcast([g for _, g, _ in chosen]), combined_scale)
        torch._foreach_mul_(m32, beta1)
        torch._foreach_add_(m32, g32, alpha=1 - beta1)
        torch._foreach_mul_(v32, beta2)
        torch._foreach_addcmul_(v32, g32, g32, value=1 - beta2)
        if self.eps_mode == 0:
            denom = torch._foreach_add(v32, group["eps"])
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(v32)
            torch._foreach_add_(denom, group["eps"])
        update = torch._foreach_div(m32, denom)
        if group["weight_decay"]:
            torch._foreach_add_(update, p32, alpha=group["weight_decay"])
        torch._foreach_add_(p32, update, alpha=-step_size)
        store(params, p32)
        store(m, m32)
        store(v, v32)
        outs = [(o, p) for (_, _, o), p in zip(chosen, p32) if o is not None]
        store([o for o, _ in outs], [p for _, p in outs])


def _per_group(value: Any, n_groups: int) -> list[Any]:
    """The pre-2019 FusedAdam's `grads`/`output_params`: None, one group's list, or a list per group."""
    if value is None:
        return [None] * n_groups
    value = list(value)
    return value if value and isinstance(value[0], (list, tuple)) else [value]
