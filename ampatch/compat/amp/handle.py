"""`apex.amp.handle`: the handle `amp.init()` returns (Apex's `AmpHandle`), `NoOpHandle`, and
Apex's `scale_loss` / `disable_casts` (ampatch's own, for `from apex.amp.handle import scale_loss`).

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
from typing import TYPE_CHECKING, Any

import torch

from ...base.patcher import disable_casts as casts_off
from ...errors import ConfigError, ConfigTypeError, OrderError
from ...session.session import current as _current

if TYPE_CHECKING:  # what __getattr__ reads from the package, for the linters (at run time: lazily, it sits above)
    from ampatch import disable_casts, scale_loss

logger = logging.getLogger("ampatch")

__all__ = ["Handle", "AmpHandle", "NoOpHandle", "scale_loss", "disable_casts"]


class Handle:
    """Apex's `AmpHandle` over one session (`None`: Apex's `NoOpHandle`, from `enabled=False`)."""

    def __init__(self, session: Any) -> None:
        self._session = session

    def _live(self, what: str) -> Any:
        """The session if it is still the live one; None for a no-op handle; raises for an ended one."""
        if self._session is None:
            return None
        if self._session is not _current():
            raise OrderError(f"handle.{what}(): this amp handle's session has ended (amp.initialize or amp.init "
                             "was called again, or handle._deactivate()); use the handle of the live session, "
                             "amp._amp_state.handle.")
        return self._session

    def is_active(self) -> bool:
        """Whether this handle's session is live and casting."""
        s = self._session
        return s is not None and s.properties.enabled and s is _current()

    def _deactivate(self) -> None:
        """Undo the session (`amp.deinitialize()`); a no-op once it has ended."""
        if self._session is not None and self._session is _current():
            from ... import deinitialize  # the public API, above this module
            deinitialize()

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

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, num_loss: int = 1) -> Any:
        """Apex's `OptimWrapper`: `wrapped.scale_loss(loss)` per backward, `wrapped.step()`."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigTypeError(f"wrap_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}.")
        if isinstance(num_loss, bool) or not isinstance(num_loss, int) or num_loss < 1:
            raise ConfigError(f"num_loss must be a positive int, got {num_loss!r}.")
        from .opt import OptimWrapper
        return OptimWrapper(self._live("wrap_optimizer"), optimizer, num_loss)

    @property
    def verbose(self) -> bool:
        return self._session is not None and self._session.verbosity >= 2

    def __repr__(self) -> str:
        state = "no-op" if self._session is None else ("active" if self.is_active() else "ended")
        return f"<ampatch amp handle ({state})>"


AmpHandle = Handle  # Apex's class name


class NoOpHandle(Handle):
    """Apex's handle for `enabled=False`: every method does nothing."""

    def __init__(self) -> None:
        super().__init__(None)


def __getattr__(name: str) -> Any:
    """`scale_loss` and `disable_casts` are ampatch's own (read from the package lazily: it
    sits above compat)."""
    if name in ("scale_loss", "disable_casts"):
        import ampatch
        return getattr(ampatch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
