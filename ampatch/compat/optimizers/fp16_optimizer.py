"""`apex.optimizers.FP16_Optimizer`: Apex's cut-down FP16_Optimizer for its fused Adam.

Pre-2019 BERT code (pytorch-pretrained-BERT, NVIDIA's BERT SQuAD `--old`) wrapped
`FusedAdam(..., bias_correction=False, max_grad_norm=1.0)` in it: `optimizer.backward(loss)`
leaves the half model's grads scaled (several backward passes add up), and `step()` checks
them, skips on overflow, and otherwise lets the wrapped optimizer step FP32 masters. Apex
flattened each param group into one FP32 master and handed FusedAdam the scale and the
group's gradient norm; here the masters are per param (`master_wrapper`), the grads are
unscaled into them first, and the pre-2019 FusedAdam computes each group's norm itself, which
is the same clipping. Dynamic scaling as Apex: start at 2**16, halve on overflow (not below 1),
double after 1000 clean steps, no ceiling; `dynamic_loss_args` is refused, as in Apex.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _flatten_dense_tensors

from ...config.values import check_scale_value
from ...errors import ConfigError, NotSupportedError
from ...optim.scaler import StateDictKeyError
from ..fp16_utils.loss_scaler import apex_scaler
from ..fp16_utils.master_wrapper import MasterWeightOptimizer

logger = logging.getLogger("ampatch")

__all__ = ["FP16_Optimizer"]

INIT_SCALE, SCALE_FACTOR, SCALE_WINDOW = 2.0 ** 16, 2.0, 1000  # Apex's fixed dynamic rule


class FP16_Optimizer(MasterWeightOptimizer):  # noqa: N801 - Apex's name
    """`apex.optimizers.FP16_Optimizer(init_optimizer, static_loss_scale=1.0,
    dynamic_loss_scale=False, dynamic_loss_args=None, verbose=True)`: `backward(loss)`,
    `step()` (skipped on overflow), `zero_grad(set_grads_to_None=True)`, `cur_scale`,
    `cur_iter`, `param_groups`, `state`, and Apex's `state_dict()` keys (`fp32_groups_flat`:
    each group's FP32 params, flattened)."""

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict[str, Any] | None = None,
                 verbose: bool = True) -> None:
        if dynamic_loss_scale:
            if dynamic_loss_args is not None:
                raise SystemError("Do not support dynamic loss scale args for now.")  # Apex's words
            scaler = apex_scaler(INIT_SCALE, dynamic=True, scale_factor=SCALE_FACTOR, scale_window=SCALE_WINDOW)
        else:
            scaler = apex_scaler(check_scale_value(static_loss_scale, "static_loss_scale"))
        super().__init__(init_optimizer, scaler)
        self.dynamic_loss_scale = bool(dynamic_loss_scale)
        self.verbose = verbose
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def cur_scale(self) -> float:
        return self._scaler.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        value = check_scale_value(value, "cur_scale")
        self._scaler.scale = self._scaler.clamp(value) if self._scaler.dynamic else value

    @property
    def scale_factor(self) -> float:
        return self._scaler.growth_factor

    @property
    def scale_window(self) -> int:
        return self._scaler.growth_interval

    def zero_grad(self, set_grads_to_None: bool = True) -> None:  # noqa: N803 - Apex's name
        """The grads to None (Apex's default here) or zero."""
        self._zero_grad(set_grads_to_None)

    def backward(self, loss: torch.Tensor) -> None:
        """`(loss.float() * cur_scale).backward()`; the grads stay scaled until `step()`."""
        self._scaled_backward(loss)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Unscale the grads into the FP32 masters; on inf/NaN skip (and lower a dynamic scale),
        else step the wrapped optimizer and copy the masters into the half model."""
        if closure is not None:
            raise NotSupportedError("apex.optimizers.FP16_Optimizer.step() takes no closure (Apex's did not "
                                    "either); use apex.fp16_utils.FP16_Optimizer for closures.")
        overflow = self._unscale()
        if overflow:
            self.last_overflow_iter = self.cur_iter
            self._skip()
            logger.info("ampatch: FP16_Optimizer: gradient overflow on iteration %d, skipping step; loss scale is "
                        "now %g", self.cur_iter, self._scaler.scale)
        else:
            self.optimizer.step()
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        """Apex's keys: dynamic_loss_scale, cur_scale, cur_iter, (dynamic:) last_overflow_iter,
        scale_factor, scale_window, optimizer_state_dict, fp32_groups_flat."""
        sd: dict[str, Any] = {"dynamic_loss_scale": self.dynamic_loss_scale, "cur_scale": self._scaler.scale,
                              "cur_iter": self.cur_iter}
        if self.dynamic_loss_scale:
            sd.update(last_overflow_iter=self.last_overflow_iter, scale_factor=self.scale_factor,
                      scale_window=self.scale_window)
        sd["optimizer_state_dict"] = self._inner_state_dict()
        sd["fp32_groups_flat"] = [_flatten_dense_tensors([p.detach() for p in g["params"]])
                                  for g in self.param_groups]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict()` saved (everything checked before anything changes)."""
        dynamic = isinstance(state_dict, dict) and bool(state_dict.get("dynamic_loss_scale"))
        keys = {"dynamic_loss_scale", "cur_scale", "cur_iter", "optimizer_state_dict", "fp32_groups_flat"}
        if dynamic:
            keys |= {"last_overflow_iter", "scale_factor", "scale_window"}
        if not isinstance(state_dict, dict) or set(state_dict) != keys:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise StateDictKeyError(f"apex.optimizers.FP16_Optimizer.load_state_dict expects the dict its "
                                    f"state_dict() returns (keys {sorted(keys)}), got {got}.")
        cur_iter = state_dict["cur_iter"]
        if isinstance(cur_iter, bool) or not isinstance(cur_iter, int) or cur_iter < 0:
            raise ConfigError(f"FP16_Optimizer.load_state_dict: cur_iter must be a non-negative int, got {cur_iter!r}.")
        scale = check_scale_value(state_dict["cur_scale"], "cur_scale")
        if dynamic:
            scaler = apex_scaler(scale, dynamic=True, scale_factor=state_dict["scale_factor"],
                                 scale_window=state_dict["scale_window"])
            last = int(state_dict["last_overflow_iter"])
            scaler.unskipped = (cur_iter - last - 1) % scaler.growth_interval  # Apex's cur_iter rule, as a count
        else:
            scaler = apex_scaler(scale)
        scaler.scale = scale
        load_masters = self._load_masters(state_dict["fp32_groups_flat"], "fp32_groups_flat", flat=True)
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])  # torch checks before it loads
        load_masters()
        self._scaler, self.dynamic_loss_scale, self.cur_iter = scaler, dynamic, cur_iter
        self.last_overflow_iter = int(state_dict["last_overflow_iter"]) if dynamic else -1

    def __repr__(self) -> str:
        kind = "dynamic" if self._scaler.dynamic else "static"
        return f"apex.optimizers.FP16_Optimizer({type(self.optimizer).__name__}, {kind} loss scale {self.cur_scale:g})"
