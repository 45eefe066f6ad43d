"""What an optimizer handle (`optim.handle.OptimizerHandle`) and whatever drives it (a
`Session`, Apex's FP16_Optimizer, a caller of its own) say to each other: where the handle's
gradients stand (`OptState`), what the driver gives it (`HandleContext`: process group,
callbacks, attributes to carry), and the check it runs at each step (`StepGuard`).
Kept apart from the mechanism so that a driver reads its contract in one screen."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from .handle import OptimizerHandle

__all__ = ["OptState", "StepGuard", "HandleContext"]


class OptState(Enum):
    """Where an optimizer's gradients stand (see `OptimizerHandle` for the transitions)."""

    FRESH = "fresh"            # no scale_loss yet
    READY = "ready"            # grads (if any) unscaled: step() applies them
    SCALED = "scaled"          # a delay_unscale backward left scaled grads: step() raises
    OVERFLOWED = "overflowed"  # an unscale found inf/NaN: the next step() is skipped


class StepGuard(Protocol):
    """Checked at each step() (`session.param_guard.ParamGuard`: the model still holds what the optimizer steps)."""

    def check(self, handle: "OptimizerHandle") -> None: ...


def _never() -> bool:
    return False


@dataclass(frozen=True)
class HandleContext:
    """What an `OptimizerHandle` needs from whatever drives it (a `Session`, or a caller of
    its own); every field has a default that suits one optimizer on its own."""

    process_group: Any = None  # where the masters are made to agree across ranks (None: the world)
    on_step: Callable[["OptimizerHandle", bool], None] | None = None  # after each step(), with `skipped`
    # skipped steps pile up (SKIP_WARNING_AFTER in a row, then twice as many...): (handle, count);
    # None: a generic RuntimeWarning
    on_skips: Callable[["OptimizerHandle", int], None] | None = None
    scales_loss: Callable[[], bool] = _never  # a loss scale other than a static 1.0 is in use
    # the handle holding an FP32 master of a param, if any (add_param_group refuses a second one)
    master_owner: Callable[[torch.Tensor], "OptimizerHandle | None"] | None = None
    level: str = ""  # the opt level, for log lines
    # step(closure) is allowed with scaling: the closure's backward is scaled and unscaled by the
    # driver itself (Apex's FP16_Optimizer.backward), not by a scale_loss it would bypass
    scaled_closures: bool = False
    # attributes to hang on the optimizer while it is patched, made per handle (the public API
    # passes Apex's `_amp_stash` maker, so the core needs no import of compat); None: none
    attributes: Callable[["OptimizerHandle"], dict[str, Any]] | None = None
