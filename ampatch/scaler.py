"""Loss scalers and the fused unscale + inf/NaN check.

A `LossScaler` is one scale (per `loss_id`): static, or dynamic (start 2**16, halve on
overflow down to `min_loss_scale`, double after `growth_interval` clean steps up to
`max_loss_scale`). State, in Apex's checkpoint format: `loss_scale` and `unskipped`.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger("ampatch")

_unscale_ = torch._amp_foreach_non_finite_check_and_unscale_


class StateDictKeyError(KeyError, ValueError):
    """An amp state dict with keys it should not have (or lacks some): a KeyError, and a
    ValueError for callers that treat a bad checkpoint as a bad value."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class LossScaler:
    """One loss scale and its update rule."""

    def __init__(self, loss_scale: float | str, min_loss_scale: float | None = None,
                 max_loss_scale: float = 2.0 ** 24, growth_interval: int = 2000,
                 init_scale: float = 2.0 ** 16) -> None:
        self.dynamic = loss_scale == "dynamic"
        self.min_loss_scale = min_loss_scale
        self.max_loss_scale = max_loss_scale
        self.growth_interval = growth_interval
        self.scale = min(init_scale, max_loss_scale) if self.dynamic else float(loss_scale)
        self.unskipped = 0
        self.last_overflow = False  # the outcome of the latest update (Apex's `_has_overflow`)
        self.history: list[tuple[int, float]] = [(0, self.scale)]  # (iteration, scale) change points

    @property
    def is_identity(self) -> bool:
        """A static scale of 1.0: scaling and unscaling are no-ops."""
        return not self.dynamic and self.scale == 1.0

    def update(self, overflow: bool, iteration: int) -> None:
        """Apply one unscale's outcome (Apex's rule); static scales never change."""
        self.last_overflow = overflow
        if overflow:
            self.unskipped = 0
            if self.dynamic:
                new = self.scale / 2.0
                if self.min_loss_scale is not None:
                    new = max(new, self.min_loss_scale)
                self._set(new, iteration)
            return
        self.unskipped += 1
        if self.dynamic and self.unskipped >= self.growth_interval:
            self.unskipped = 0
            self._set(min(self.scale * 2.0, self.max_loss_scale), iteration)

    def _set(self, scale: float, iteration: int) -> None:
        if scale != self.scale:
            self.scale = scale
            self.history.append((iteration, scale))

    def state_dict(self) -> dict[str, float | int]:
        return {"loss_scale": float(self.scale), "unskipped": int(self.unskipped)}

    @staticmethod
    def check_state(state: object) -> tuple[float, int]:
        """Validate one saved scaler state; returns (loss_scale, unskipped). Raises before
        anything is loaded, so a bad checkpoint leaves every scaler as it was."""
        if not isinstance(state, dict):
            raise TypeError(f"a loss scaler state is a dict with 'loss_scale' and 'unskipped', got "
                            f"{type(state).__name__}.")
        keys = {"loss_scale", "unskipped"}
        if set(state) != keys:
            unknown, missing = sorted(set(state) - keys), sorted(keys - set(state))
            raise StateDictKeyError(f"loss scaler state: unknown keys {unknown}, missing keys {missing}; expected "
                           "exactly 'loss_scale' and 'unskipped' (the format of amp.state_dict()).")
        scale, unskipped = float(state["loss_scale"]), int(state["unskipped"])
        if not (0.0 < scale < float("inf")) or unskipped < 0:
            raise ValueError(f"loss scaler state {state!r}: loss_scale must be a finite positive number and "
                             "unskipped a non-negative int.")
        return scale, unskipped

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.unskipped = self.check_state(state)


def unscale_(grads: Sequence[torch.Tensor], inv_scale: float, found_inf: torch.Tensor | None) -> torch.Tensor:
    """Multiply `grads` in place by `inv_scale` and OR any inf/NaN into `found_inf`.

    One fused kernel per device (grads of mixed dtypes are fine); returns the flag.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        if found_inf is None:
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
        flag = found_inf if found_inf.device == device else torch.zeros((), dtype=torch.float32, device=device)
        inv = torch.full((), inv_scale, dtype=torch.float32, device=device)
        _unscale_(group, flag, inv)
        if flag is not found_inf:
            found_inf = torch.maximum(found_inf, flag.to(found_inf.device))
    if found_inf is None:
        found_inf = torch.zeros((), dtype=torch.float32)
    return found_inf


def distributed(process_group=None) -> bool:
    """torch.distributed is initialized and `process_group` (default: the world) has several ranks."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1


def overflowed(found_inf: torch.Tensor, process_group=None) -> bool:
    """Host-side verdict; under torch.distributed every rank gets the same answer (MAX)."""
    if distributed(process_group):
        flag = found_inf.clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        return bool(flag.item())
    return bool(found_inf.item())
