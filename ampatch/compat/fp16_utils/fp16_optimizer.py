"""`apex.fp16_utils.FP16_Optimizer`: Apex's manual mixed-precision wrapper.

Apex-era scripts made the model half by hand (`model.half()`, `network_to_half`) and wrapped
the optimizer: `optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)`, then
`optimizer.backward(loss)` and `optimizer.step()`. Here it is a thin layer over
`master_wrapper.MasterWeightOptimizer` (an `OptimizerHandle` and a `LossScaler`, no
session), with Apex's methods, attributes and checkpoint keys.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ...config.values import DEFAULT_MAX_LOSS_SCALE, check_scale_value
from ...errors import ConfigTypeError, InvalidCallError, OrderError
from ...optim.context import GradStage
from ...optim.scaler import LossScaler, StateDictKeyError
from ..amp.scaler import LossScalerView
from .loss_scaler import apex_scaler
from .master_wrapper import MasterWeightOptimizer, WrapperOwner

logger = logging.getLogger("ampatch")

__all__ = ["FP16_Optimizer", "DYNAMIC_DEFAULTS"]

# Apex's amp LossScaler arguments (FP16_Optimizer's dynamic_loss_args) and their defaults.
DYNAMIC_DEFAULTS = {"init_scale": 2.0 ** 16, "scale_factor": 2.0, "scale_window": 2000, "min_loss_scale": None,
                    "max_loss_scale": DEFAULT_MAX_LOSS_SCALE}


def _dynamic_scaler(args: dict[str, Any] | None) -> LossScaler:
    """Apex's `LossScaler("dynamic", **dynamic_loss_args)` (amp's scaler, as Apex's last
    FP16_Optimizer used); `scale_factor` is honoured (Apex's last version fixed it at 2)."""
    args = dict(args or {})
    unknown = sorted(set(args) - set(DYNAMIC_DEFAULTS))
    if unknown:
        raise ConfigTypeError(f"FP16_Optimizer(dynamic_loss_args=...): unknown keys {unknown}; Apex's loss scaler "
                              f"takes {', '.join(DYNAMIC_DEFAULTS)}.")
    a = {**DYNAMIC_DEFAULTS, **args}
    low = None if a["min_loss_scale"] is None else check_scale_value(a["min_loss_scale"], "min_loss_scale")
    return apex_scaler(check_scale_value(a["init_scale"], "init_scale"), dynamic=True,
                       scale_factor=a["scale_factor"], scale_window=a["scale_window"], min_loss_scale=low,
                       max_loss_scale=check_scale_value(a["max_loss_scale"], "max_loss_scale"))


def _scaler_state(scaler: LossScaler) -> dict[str, Any]:
    """The 'loss_scaler' entry of a state dict: plain numbers (Apex pickled its scaler object,
    which `torch.load`'s default `weights_only=True` refuses)."""
    return {**scaler.state_dict(), "dynamic": scaler.dynamic, "scale_window": scaler.growth_interval,
            "scale_factor": scaler.growth_factor, "min_loss_scale": scaler.min_loss_scale,
            "max_loss_scale": scaler.max_loss_scale}


def _scaler_from(state: Any) -> LossScaler:
    """A scaler from `_scaler_state`'s dict, checked."""
    keys = {"loss_scale", "unskipped", "dynamic", "scale_window", "scale_factor", "min_loss_scale", "max_loss_scale"}
    if not isinstance(state, dict) or set(state) != keys:
        raise StateDictKeyError(f"FP16_Optimizer.load_state_dict: 'loss_scaler' must be the dict FP16_Optimizer."
                                f"state_dict() saves, with keys {sorted(keys)}; got "
                                f"{sorted(state) if isinstance(state, dict) else type(state).__name__}.")
    if state["dynamic"]:
        scaler = _dynamic_scaler({"scale_window": state["scale_window"], "scale_factor": state["scale_factor"],
                                  "min_loss_scale": state["min_loss_scale"],
                                  "max_loss_scale": state["max_loss_scale"]})
    else:
        scaler = apex_scaler(check_scale_value(state["loss_scale"], "loss_scale"))
    scaler.scale, scaler.unskipped = LossScaler.check_state({"loss_scale": state["loss_scale"],
                                                             "unskipped": state["unskipped"]})
    return scaler


class FP16_Optimizer(MasterWeightOptimizer):  # noqa: N801 - Apex's name
    """`apex.fp16_utils.FP16_Optimizer(init_optimizer, static_loss_scale=1.0,
    dynamic_loss_scale=False, dynamic_loss_args=None, verbose=True)`.

    `backward(loss, update_master_grads=True, retain_graph=False)` scales the loss, runs its
    backward and (unless told not to) unscales the new grads into the FP32 masters, adding
    them to what is there, with the inf/NaN check that sets `overflow` and updates the scale
    (dynamic: Apex's amp rule, `dynamic_loss_args` `init_scale=2**16`, `scale_window=2000`,
    `scale_factor=2`, `min_loss_scale`, `max_loss_scale=2**24`). `step()` is skipped while
    `overflow` is True (at a static scale too: Apex applied the inf/NaN); otherwise the
    wrapped optimizer steps the masters and the half model takes their values.
    `state_dict()` has Apex's keys and resumes bit for bit.
    """

    def __init__(self, init_optimizer: torch.optim.Optimizer, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args: dict[str, Any] | None = None,
                 verbose: bool = True) -> None:
        if not isinstance(dynamic_loss_scale, bool):
            raise ConfigTypeError(f"dynamic_loss_scale must be True or False, got {dynamic_loss_scale!r}.")
        if dynamic_loss_scale:
            scaler = _dynamic_scaler(dynamic_loss_args)
        else:
            scaler = apex_scaler(check_scale_value(static_loss_scale, "static_loss_scale"))
        super().__init__(init_optimizer, scaler)
        self.verbose = verbose
        self.dynamic_loss_scale = dynamic_loss_scale
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = torch.nn.utils.clip_grad_norm_
        self.loss_scaler = LossScalerView(WrapperOwner(self._handle, self.name), scaler)
        for i, (half, own) in enumerate(zip(self.fp16_groups, self.fp32_from_fp32_groups)):
            self.maybe_print(f"FP16_Optimizer processing param group {i}: {len(half)} half params (FP32 masters), "
                             f"{len(own)} FP32 params")

    def maybe_print(self, msg: str) -> None:
        """Apex printed this with `verbose`; here it is a debug log line."""
        if self.verbose:
            logger.debug("ampatch: %s", msg)

    # ------------------------------------------------------------------ the loss scale
    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = value

    # ------------------------------------------------------------------ training
    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803 - Apex's name
        """Zero (or set to None) the grads of the masters, the FP32 params and the half model."""
        self._zero_grad(set_grads_to_None)

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """Scale the loss (in FP32) and backward; then `update_master_grads()` unless told not to
        (several backward passes, one update: their grads add up)."""
        self._scaled_backward(loss, retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Unscale the grads of the backward passes since the last update into the FP32
        masters (added to theirs), check them, update the scale and `overflow`."""
        overflow = self._unscale()
        if overflow is not None:
            self.overflow = overflow

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the masters and copy them into the half model; skipped while `overflow`."""
        if self._handle.stage is GradStage.SCALED:
            raise OrderError("FP16_Optimizer.step(): backward(loss, update_master_grads=False) left gradients "
                             "that are not in the masters yet; call optimizer.update_master_grads() first.")
        if self.overflow:
            self._skip()
            logger.info("ampatch: FP16_Optimizer: gradient overflow, skipping step; loss scale is now %g",
                        self._scaler.scale)
            return None
        if closure is None:
            return self.optimizer.step()
        return self._step_with_closure(closure)

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        """The wrapped optimizer calls the closure (which calls `backward`), as often as it
        needs; a closure whose grads overflowed runs again at the lowered scale."""
        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:  # the optimizer may have moved the masters since the last call
                self._handle.masters.copy_to_model()
            loss = closure()
            while self.overflow:
                before = self._scaler.scale
                logger.info("ampatch: FP16_Optimizer: gradient overflow within the closure; running it again at "
                            "loss scale %g", before)
                if not self._scaler.dynamic or before <= self._scaler.floor:
                    raise InvalidCallError(f"FP16_Optimizer.step(closure): the closure's gradients are not finite at "
                                           f"loss scale {before:g}, which cannot go lower.")
                loss = closure()
            return loss

        try:
            return self.optimizer.step(wrapped_closure)
        finally:
            self.first_closure_call_this_step = True

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> Any:
        """Clip the FP32 master grads (all the optimizer's params); returns their total norm,
        or -1 after an overflow (as Apex)."""
        if self.overflow:
            return -1
        return self.clip_grad_norm(list(self._handle.params()), max_norm, norm_type)

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """Per param group, the grads of what the optimizer steps; None after an overflow."""
        if self.overflow:
            logger.warning("ampatch: FP16_Optimizer.inspect_master_grad_data() in an overflow state: the gradients "
                           "are not valid; returning None.")
            return None
        return [[p.grad.data if p.grad is not None else None for p in g["params"]] for g in self.param_groups]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Apex's keys: loss_scaler (plain numbers here), dynamic_loss_scale, overflow,
        first_closure_call_this_step, optimizer_state_dict, fp32_from_fp16 (the masters)."""
        return {"loss_scaler": _scaler_state(self._scaler), "dynamic_loss_scale": self.dynamic_loss_scale,
                "overflow": self.overflow, "first_closure_call_this_step": self.first_closure_call_this_step,
                "optimizer_state_dict": self._inner_state_dict(), "fp32_from_fp16": self._masters_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict()` saved: the scaler (its rule included, as Apex replaced its
        scaler object), the wrapped optimizer's state, the FP32 masters (and the half model
        from them). Everything is checked before anything changes."""
        keys = {"loss_scaler", "dynamic_loss_scale", "overflow", "first_closure_call_this_step",
                "optimizer_state_dict", "fp32_from_fp16"}
        if not isinstance(state_dict, dict) or set(state_dict) != keys:
            got = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise StateDictKeyError(f"FP16_Optimizer.load_state_dict expects the dict FP16_Optimizer.state_dict() "
                                    f"returns (keys {sorted(keys)}), got {got}.")
        scaler = _scaler_from(state_dict["loss_scaler"])
        load_masters = self._load_masters(state_dict["fp32_from_fp16"], "fp32_from_fp16")
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])  # torch checks before it loads
        load_masters()
        self._scaler = scaler
        self.loss_scaler = LossScalerView(WrapperOwner(self._handle, self.name), scaler)
        self.dynamic_loss_scale = bool(state_dict["dynamic_loss_scale"])
        self.overflow = bool(state_dict["overflow"])
        self.first_closure_call_this_step = bool(state_dict["first_closure_call_this_step"])

    def __repr__(self) -> str:
        kind = "dynamic" if self._scaler.dynamic else "static"
        return f"FP16_Optimizer({type(self.optimizer).__name__}, {kind} loss scale {self._scaler.scale:g})"
