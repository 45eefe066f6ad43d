"""Apex's amp `LossScaler` object, as a view over one of ampatch's `scaler.LossScaler`s.

Real scripts reach into Apex's scaler: NVIDIA's BERT writes `_loss_scale`, reads
`loss_scale()`, swaps in its own `_overflow_buf` and calls `update_scale()` after an
all-reduce of its own; GNMT sets `_scale_seq_len` (the growth interval). `LossScalerView`
gives those attributes over the live scaler (no copy of its state); what it belongs to (an
amp session, an `FP16_Optimizer`) is a `ScalerOwner`, which also decides what a write of the
scale means.

ampatch settles every unscale's overflow itself (the scale is updated and the step skipped
when `scale_loss` ends, or at the deferred check), so `update_scale()` adds only what ampatch
has not seen: an overflow the script found itself (its `_overflow_buf` set, or
`_has_overflow = True`). It returns Apex's `should_skip`, and then the caller owns the skip:
the optimizers' pending skip is taken at once (counted as a skipped step), so that the next,
clean `step()` the script calls is not skipped as well.
"""
from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from ...errors import ConfigTypeError, ReadOnlyError
from ...optim import scaler as core
from ...optim.context import GradStage
from ...optim.handle import OptimizerHandle
from ..extensions.kernels import has_inf_or_nan

logger = logging.getLogger("ampatch")

__all__ = ["LossScaler", "LossScalerView", "ScalerOwner", "scale_check_overflow_python", "axpby_check_overflow_python"]

_READ_ONLY = ("dynamic", "_max_loss_scale", "_min_loss_scale")


class ScalerOwner(Protocol):
    """What a `LossScalerView` needs from whatever owns its scaler."""

    def live(self) -> None:
        """Raise if the scaler is no longer in use; settle deferred overflow verdicts."""

    def handles(self) -> list[OptimizerHandle]:
        """The optimizers whose next step an overflow skips."""

    def iteration(self) -> int:
        """The current iteration (for the scale history)."""

    def set_scale(self, scaler: core.LossScaler, value: Any) -> None:
        """Write `value` as the current scale, validated, with this owner's rule for a static scale."""

    def describe(self) -> str:
        """How messages name the scaler (`_amp_state.loss_scalers[0]`, ...)."""


def device_of(handles: list[OptimizerHandle]) -> torch.device:
    """Where the optimizers' params live (CPU when there are none)."""
    for h in handles:
        for p in h.params():
            return p.device
    return torch.device("cpu")


class LossScalerView:
    """Apex's amp `LossScaler` attributes over `scaler`, owned by `owner`.

    Read: `loss_scale()`, `_loss_scale`, `_unskipped`, `_has_overflow`, `_scale_seq_len`,
    `_overflow_buf`, `dynamic`, `_min_loss_scale`, `_max_loss_scale`. Written: `_loss_scale`
    (the owner's rule), `_unskipped`, `_scale_seq_len` (takes effect at the next clean
    step), `_overflow_buf` and `_has_overflow` (an overflow found by the script, settled by
    `update_scale()`). Other attributes a script sets are kept on the view, as Apex's plain
    object kept them; `dynamic` and the min/max scales are configuration and refuse writes.
    """

    __slots__ = ("_owner", "_scaler", "_buf", "_own_buf", "_filled", "_pending", "_extra")

    def __init__(self, owner: ScalerOwner, scaler: core.LossScaler) -> None:
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_scaler", scaler)
        object.__setattr__(self, "_buf", None)
        object.__setattr__(self, "_own_buf", True)   # _buf is ours (it follows the last unscale)
        object.__setattr__(self, "_filled", 0)       # what ours was last set to
        object.__setattr__(self, "_pending", False)  # `_has_overflow = True` written by the script
        object.__setattr__(self, "_extra", {})

    def _resolved(self) -> core.LossScaler:
        self._owner.live()
        return self._scaler

    # ------------------------------------------------------------------ the scale
    def loss_scale(self) -> float:
        """The current scale (Apex's method)."""
        return self._resolved().scale

    @property
    def _loss_scale(self) -> float:
        return self.loss_scale()

    @_loss_scale.setter
    def _loss_scale(self, value: float) -> None:
        self._owner.set_scale(self._resolved(), value)

    @property
    def _unskipped(self) -> int:
        return self._resolved().unskipped

    @_unskipped.setter
    def _unskipped(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):  # int(-1.5) would pass the state check
            raise ConfigTypeError(f"_unskipped must be a non-negative int, got {value!r}.")
        scaler = self._resolved()
        scaler.load_state_dict({**scaler.state_dict(), "unskipped": value})

    @property
    def _scale_seq_len(self) -> int:
        """The growth interval: clean steps before a dynamic scale grows."""
        return self._scaler.growth_interval

    @_scale_seq_len.setter
    def _scale_seq_len(self, value: int) -> None:
        self._resolved().growth_interval = value  # checked by the scaler

    @property
    def dynamic(self) -> bool:
        return self._scaler.dynamic

    @property
    def _max_loss_scale(self) -> float:
        return self._scaler.max_loss_scale

    @property
    def _min_loss_scale(self) -> float | None:
        return self._scaler.min_loss_scale

    # ------------------------------------------------------------------ overflow
    @property
    def _has_overflow(self) -> bool:
        """Whether the last unscale overflowed (or the script said so since)."""
        return bool(self._resolved().last_overflow) or self._pending

    @_has_overflow.setter
    def _has_overflow(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigTypeError(f"_has_overflow must be True or False, got {value!r}.")
        self._resolved()
        object.__setattr__(self, "_pending", value)

    @property
    def _overflow_buf(self) -> torch.Tensor:
        """Apex's int flag tensor: ours holds 1 when the last unscale overflowed (a kernel the
        script runs may set it too); a buffer the script assigned is returned as it is."""
        scaler = self._resolved()
        if self._own_buf:
            if self._buf is None:
                object.__setattr__(self, "_buf", torch.zeros(1, dtype=torch.int,
                                                             device=device_of(self._owner.handles())))
            object.__setattr__(self, "_filled", int(scaler.last_overflow))
            self._buf.fill_(self._filled)
        return self._buf

    @_overflow_buf.setter
    def _overflow_buf(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor) or value.numel() < 1:
            raise ConfigTypeError(f"_overflow_buf must be a tensor (Apex's int flag buffer), got "
                                  f"{type(value).__name__}.")
        self._resolved()
        object.__setattr__(self, "_buf", value)
        object.__setattr__(self, "_own_buf", False)

    def clear_overflow_state(self) -> None:
        """Apex's: a new window starts (`_has_overflow` False, the flag buffer zeroed); a skip
        ampatch has pending stays."""
        self._resolved().last_overflow = False
        object.__setattr__(self, "_pending", False)
        object.__setattr__(self, "_filled", 0)
        if self._buf is not None:
            self._buf.zero_()

    def _script_flag(self) -> bool:
        """Whether the flag buffer says overflow where ampatch did not put it (the script's
        own buffer set, or ours set by a kernel the script ran since ampatch last filled it)."""
        if self._buf is None:
            return False
        value = int(self._buf.reshape(-1)[0].item())
        return value != 0 and (not self._own_buf or value != self._filled)

    def update_scale(self) -> bool:
        """Apex's `update_scale()`: returns should_skip.

        An overflow the script found (`_overflow_buf` non-zero, `_has_overflow = True`) that
        ampatch has not seen since the last step (the last unscale overflowed, or a skip is
        pending) updates the scale as an overflow does. When the answer is True the caller
        skips the step itself, so the optimizers' pending skip is taken now (a skipped step,
        params and state untouched); a later clean `step()` runs."""
        scaler = self._resolved()
        found = self._pending or self._script_flag()
        object.__setattr__(self, "_pending", False)
        handles = self._owner.handles()
        # an overflow ampatch saw since the last step (a skip still pending) is the same overflow
        seen = scaler.last_overflow or any(h.stage is GradStage.OVERFLOWED for h in handles)
        if found and not seen:
            before = scaler.scale
            scaler.update(True, self._owner.iteration())
            logger.info("ampatch: %s.update_scale(): the script's overflow flag is set; skipping the step, loss "
                        "scale %g -> %g", self._owner.describe(), before, scaler.scale)
            for h in handles:
                h.skip_next_step()
        if not (seen or found):
            return False
        scaler.last_overflow = True  # this window overflowed: what `_has_overflow` says until the next unscale
        for h in handles:
            h.settle_skip()
        return True

    # ------------------------------------------------------------------ everything else
    def __getattr__(self, name: str) -> Any:
        extra = object.__getattribute__(self, "_extra")
        if name in extra:
            return extra[name]
        raise AttributeError(f"Apex's LossScaler attribute {name!r} is not provided by ampatch's view "
                             f"({self._owner.describe()}); see 'Coming from Apex' in the README.")

    def __setattr__(self, name: str, value: Any) -> None:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property) and prop.fset is not None:
            prop.fset(self, value)
            return
        if name in _READ_ONLY or hasattr(type(self), name):
            raise ReadOnlyError(f"{self._owner.describe()}.{name} cannot be set; _loss_scale, _unskipped, "
                                "_scale_seq_len, _overflow_buf and _has_overflow can (min/max scale and dynamic "
                                "scaling are configuration: amp.initialize arguments).")
        self._extra[name] = value  # Apex's scaler was a plain object: a script's own attribute stays with it

    def __repr__(self) -> str:
        s = self._scaler
        return (f"LossScalerView(loss_scale={s.scale}, dynamic={s.dynamic}, unskipped={s.unskipped}, "
                f"has_overflow={s.last_overflow}, scale_seq_len={s.growth_interval})")


LossScaler = LossScalerView  # Apex's name: the class of `_amp_state.loss_scalers[i]`


def scale_check_overflow_python(model_grad: torch.Tensor, master_grad: torch.Tensor, scale: float,
                                check_overflow: bool = False) -> bool | None:
    """Apex's Python fallback: `master_grad = model_grad * scale` (in place when they are the
    same tensor); with `check_overflow`, True (and nothing written) if `model_grad` holds an
    inf or a NaN."""
    if check_overflow and has_inf_or_nan(model_grad):
        return True
    if master_grad is not model_grad:
        master_grad.copy_(model_grad)
    if scale != 1.0:
        master_grad.mul_(scale)
    return False


def axpby_check_overflow_python(model_grad: torch.Tensor, stashed_grad: torch.Tensor, master_grad: torch.Tensor,
                                a: float, b: float, check_overflow: bool = False) -> bool | None:
    """Apex's Python fallback: `master_grad = a * model_grad + b * stashed_grad`; with
    `check_overflow`, True (and nothing written) if `model_grad` holds an inf or a NaN."""
    if check_overflow and has_inf_or_nan(model_grad):
        return True
    torch.add(model_grad.to(master_grad.dtype) * a, stashed_grad.to(master_grad.dtype), alpha=b, out=master_grad)
    return False
