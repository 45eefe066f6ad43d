"""`amp.init()`, Apex's older O1-only entry point, and the handle it returns.

`amp.init()` is `amp.initialize([], opt_level="O1")`: torch is patched, no model or optimizer
yet. The handle is a view of that session: `handle.scale_loss(loss, optimizer)` brings the
optimizer into the session and scales like `amp.scale_loss`; `handle.wrap_optimizer(opt,
num_loss)` returns an object whose `scale_loss(loss)` uses one loss scaler per backward pass
of an iteration and whose `step()` is skipped after an overflow; `handle._deactivate()` is
`amp.deinitialize()`. `_amp_state.handle` is the same kind of handle over the live session,
whatever its level.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

import ampatch

from .. import levels
from ..patching import disable_casts as casts_off
from ..live import current as _current

logger = logging.getLogger("ampatch")

__all__ = ["Handle", "OptimWrapper", "init"]


class Handle:
    """Apex's `AmpHandle` over one session (`None`: Apex's `NoOpHandle`, from `enabled=False`)."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def _live(self, what: str) -> Any:
        """The session if it is still the live one; None for a no-op handle; raises for an ended one."""
        if self._session is None:
            return None
        if self._session is not _current():
            raise RuntimeError(f"handle.{what}(): this amp handle's session has ended (amp.initialize or amp.init "
                               "was called again, or handle._deactivate()); use the handle of the live session, "
                               "amp._amp_state.handle.")
        return self._session

    def is_active(self) -> bool:
        """Whether this handle's session is live and casting."""
        s = self._session
        return s is not None and s is _current() and s.properties.enabled

    def _deactivate(self) -> None:
        """Undo the session (`amp.deinitialize()`); a no-op once it has ended."""
        if self._session is not None and self._session is _current():
            ampatch.deinitialize()

    def _disable_casts(self) -> contextlib.AbstractContextManager:
        """No casting inside the block (this thread), as `amp.disable_casts()`."""
        return casts_off()

    disable_casts = _disable_casts

    def _clear_cache(self) -> None:
        s = self._live("_clear_cache")
        if s is not None:
            s.cache.clear()

    def scale_loss(self, loss: torch.Tensor, optimizer: Any) -> contextlib.AbstractContextManager:
        """`amp.scale_loss(loss, optimizer)`, for an optimizer amp.initialize never saw."""
        s = self._live("scale_loss")
        if s is None:
            return contextlib.nullcontext(loss)
        for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
            s.add_optimizer(opt)
        return s.scale_loss(loss, optimizer)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> "OptimWrapper":
        """Apex's `OptimWrapper`: `wrapped.scale_loss(loss)` per backward, `wrapped.step()`."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"wrap_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ValueError(f"num_loss must be a positive int, got {num_loss!r}.")
        return OptimWrapper(self._live("wrap_optimizer"), optimizer, num_loss)

    @property
    def verbose(self) -> bool:
        return self._session is not None and self._session.verbosity >= 2

    def __repr__(self) -> str:
        state = "no-op" if self._session is None else ("active" if self.is_active() else "ended")
        return f"<ampatch amp handle ({state})>"


class OptimWrapper:
    """What `handle.wrap_optimizer` returns: one loss scaler per `scale_loss` call of an
    iteration (up to `num_loss`), and a `step()` skipped when any of them overflowed."""

    def __init__(self, session: Any, optimizer: torch.optim.Optimizer, num_loss: int) -> None:
        self._session = session
        self._optimizer = optimizer
        self._num_loss = num_loss
        self._loss_idx = 0
        if session is not None:
            session.add_optimizer(optimizer, num_losses=num_loss)

    def scale_loss(self, loss: torch.Tensor) -> contextlib.AbstractContextManager:
        if self._session is None:
            return contextlib.nullcontext(loss)
        if self._loss_idx >= self._num_loss:
            raise RuntimeError(f"wrap_optimizer(optimizer, num_loss={self._num_loss}): scale_loss was called "
                               f"{self._loss_idx + 1} times before step(); pass num_loss={self._loss_idx + 1}.")
        loss_id, self._loss_idx = self._loss_idx, self._loss_idx + 1
        return self._session.scale_loss(loss, self._optimizer, loss_id=loss_id)

    def step(self, closure: Any = None) -> Any:
        """The optimizer's step (ampatch's patched step skips it after an overflow)."""
        self._loss_idx = 0
        return self._optimizer.step() if closure is None else self._optimizer.step(closure)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return repr(self._optimizer)


def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False, patch_type: Any = None) -> Handle:
    """Apex's old entry point: patch torch as O1 (O4 with `patch_type=torch.bfloat16`, ROCm
    Apex's keyword) with no models or optimizers, and return a handle over that session."""
    for name, value in (("enabled", enabled), ("enable_caching", enable_caching), ("verbose", verbose)):
        if not isinstance(value, bool):
            raise TypeError(f"amp.init({name}=...) must be True or False, got {value!r}.")
    if not enabled:
        return Handle(None)
    if not enable_caching:
        logger.info("ampatch: amp.init(enable_caching=False): the cast cache stays on (it never serves a stale "
                    "or no_grad cast); results are the same as without it.")
    half = levels.parse_dtype(patch_type, "patch_type")
    level = "O4" if half == torch.bfloat16 else "O1"
    ampatch.initialize([], opt_level=level, loss_scale=loss_scale, allow_banned=allow_banned,
                       half_dtype=half if level == "O1" else None, verbosity=2 if verbose else 1)
    return Handle(_current())
