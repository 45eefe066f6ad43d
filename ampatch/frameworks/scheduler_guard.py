"""An LR scheduler that does not step after a skipped optimizer step.

A framework's training loop (Lightning, the Hugging Face Trainer) steps its scheduler after
every `optimizer.step()`; when ampatch skipped that step (its grads overflowed), the
learning rate must stay where it was, as it does for a hand-written loop that checks
`amp.last_step_skipped(optimizer)` (and torch must not warn that the scheduler stepped
before its optimizer). `hold_on_skip` puts that check in the scheduler's own `step`, as
an instance attribute that its `state_dict` leaves out, so checkpoints stay plain data.
`wrapped_by_scheduler`, registered with the patcher on `import ampatch`: a scheduler made
before `initialize` wraps the patched `optimizer.step` (to see it called), which is expected.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..base.patcher import Patcher, tolerate

logger = logging.getLogger("ampatch")

PATCHED = ("step", "state_dict")


def hold_on_skip(scheduler: Any, skipped: Callable[[], bool], patcher: Patcher) -> None:
    """Make `scheduler.step()` do nothing while `skipped()` is true, through `patcher` (its
    `restore_all` undoes it; holding the same scheduler twice is refused there)."""
    own_step, own_state_dict = scheduler.step, scheduler.state_dict

    def step(*args: Any, **kwargs: Any) -> Any:
        if skipped():
            logger.debug("ampatch: the optimizer step was skipped (overflow); the LR scheduler does not step.")
            return None
        return own_step(*args, **kwargs)

    def state_dict() -> dict:
        return {k: v for k, v in own_state_dict().items() if k not in PATCHED}

    patcher.patch(scheduler, "step", step)
    patcher.patch(scheduler, "state_dict", state_dict)


def wrapped_by_scheduler(replacement: Any) -> bool:
    """Whether `replacement` is torch's LR-scheduler wrapper of an optimizer's `step` (it marks
    it `_wrapped_by_lr_sched`): restoring the patch under it is expected, not news."""
    return bool(getattr(replacement, "_wrapped_by_lr_sched", False))


tolerate(wrapped_by_scheduler)
