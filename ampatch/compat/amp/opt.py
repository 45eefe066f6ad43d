"""`apex.amp.opt`: `OptimWrapper`, what `handle.wrap_optimizer(optimizer, num_loss)` returns."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from ampatch.errors import OrderError

__all__ = ["OptimWrapper"]


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
            raise OrderError(f"wrap_optimizer(optimizer, num_loss={self._num_loss}): scale_loss was called "
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
