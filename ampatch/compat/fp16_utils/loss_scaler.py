"""`apex.fp16_utils.LossScaler` and `DynamicLossScaler`: Apex's stand-alone loss scalers, for
scripts that scale by hand (`loss_scaler.backward(loss)`, `has_overflow(params)`,
`update_scale(overflow)`). Each is a thin layer over `scaler.LossScaler` with Apex's rules:
static, or dynamic starting at `init_scale` (2**32), divided by `scale_factor` on overflow
down to 1, multiplied by it after `scale_window` (1000) clean iterations, without a ceiling.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ...config.values import USABLE_RANGE, check_scale_value
from ...optim import scaler as core
from ..extensions.kernels import has_inf_or_nan, nonfinite
from .fp16util import to_python_float

__all__ = ["LossScaler", "DynamicLossScaler", "has_inf_or_nan", "apex_scaler", "to_python_float"]


def apex_scaler(scale: float, dynamic: bool = False, scale_factor: float = 2.0, scale_window: int = 1000,
                min_loss_scale: float | None = 1.0, max_loss_scale: float = USABLE_RANGE[1]) -> core.LossScaler:
    """The core loss scaler with the rule of Apex's stand-alone scalers (and both
    FP16_Optimizers): static at `scale`, or dynamic from `scale`, divided by `scale_factor`
    on overflow down to `min_loss_scale` (1), multiplied by it after `scale_window` clean
    iterations, with no ceiling but the usable range. The one place compat builds a core scaler."""
    scale = check_scale_value(scale, "loss scale")
    if not dynamic:
        return core.LossScaler(scale)
    return core.LossScaler("dynamic", min_loss_scale=min_loss_scale, max_loss_scale=max_loss_scale,
                           growth_interval=scale_window, init_scale=scale, growth_factor=scale_factor)




def _grads_overflow(params: Iterable[torch.Tensor]) -> bool:
    """Whether any param's grad holds an inf or a NaN (a read-only foreach check)."""
    return bool(nonfinite([p.grad.detach() for p in params if p.grad is not None]))


class _ScalerBase:
    """What both scalers share: the scale as Apex's `loss_scale` property, `backward`, `scale_gradient`."""

    _core: core.LossScaler

    @property
    def loss_scale(self) -> float:
        return self._core.scale

    @property
    def cur_scale(self) -> float:
        return self._core.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        value = check_scale_value(value, "cur_scale")
        self._core.scale = self._core.clamp(value) if self._core.dynamic else value

    def scale_gradient(self, module: nn.Module, grad_in: tuple, grad_out: tuple) -> tuple:
        """A backward hook that multiplies the incoming gradients by the scale (Apex's helper)."""
        return tuple(self.loss_scale * g if g is not None else None for g in grad_in)

    def backward(self, loss: torch.Tensor) -> None:
        """`(loss * loss_scale).backward()`."""
        (loss * self.loss_scale).backward()


class LossScaler(_ScalerBase):
    """A static loss scale (Apex's `LossScaler(scale=1)`): `has_overflow` is always False and
    `update_scale` changes nothing, as in Apex."""

    def __init__(self, scale: float = 1) -> None:
        self._core = apex_scaler(check_scale_value(scale, "scale"))

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        """A static scale stays."""

    def __repr__(self) -> str:
        return f"LossScaler(scale={self.loss_scale})"


class DynamicLossScaler(_ScalerBase):
    """Apex's `DynamicLossScaler(init_scale=2**32, scale_factor=2., scale_window=1000)`.

    `update_scale(overflow)`: on overflow the scale is divided by `scale_factor` (not below 1);
    after `scale_window` iterations without one it is multiplied by it. `cur_iter` counts the
    updates and `last_overflow_iter` is the last one that overflowed, as in Apex."""

    def __init__(self, init_scale: float = 2 ** 32, scale_factor: float = 2.0, scale_window: int = 1000) -> None:
        init_scale = check_scale_value(init_scale, "init_scale")
        self._core = apex_scaler(init_scale, dynamic=True, scale_factor=scale_factor, scale_window=scale_window)
        self.cur_iter = 0
        self.last_overflow_iter = -1

    @property
    def scale_factor(self) -> float:
        return self._core.growth_factor

    @property
    def scale_window(self) -> int:
        return self._core.growth_interval

    @staticmethod
    def _has_inf_or_nan(x: torch.Tensor) -> bool:
        return has_inf_or_nan(x)

    def has_overflow(self, params: Iterable[torch.Tensor]) -> bool:
        """Whether any of `params` has an inf/NaN gradient."""
        return _grads_overflow(params)

    def update_scale(self, overflow: bool) -> None:
        """Apply one iteration's outcome (see the class docstring)."""
        if overflow:
            self.last_overflow_iter = self.cur_iter
        self._core.update(bool(overflow), self.cur_iter)
        self.cur_iter += 1

    def __repr__(self) -> str:
        return (f"DynamicLossScaler(cur_scale={self.cur_scale}, scale_factor={self.scale_factor}, "
                f"scale_window={self.scale_window}, cur_iter={self.cur_iter})")

