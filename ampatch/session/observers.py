"""What watches a session's losses and steps from outside its job, attached from one list.

The session tells each observer about every loss it scales (loss id 0) and every step of
its first optimizer, and closes them when it closes. `attach` makes the list from the
environment (`env.Overrides`): the report written at exit (AMPATCH_REPORT), the diagnose
recorder (AMPATCH_DIAGNOSE: started by the `RecorderFactory` the caller passes in, the public API's
`ampatch.record`, which sits beside the session and is not imported here), the weights witness beside the
report (AMPATCH_WITNESS, `witness`), and the end of the process after N steps
(AMPATCH_MAX_STEPS), last, so that the others saw the final step first.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from ..base.exit_json import check_writable, exit_report
from ..config.env import DIAGNOSE, MAX_STEPS, REPORT, WITNESS, Overrides
from ..errors import OrderError
from .witness import WeightWitness

logger = logging.getLogger("ampatch")

__all__ = ["Observer", "RecorderFactory", "StopAfter", "ReportAtExit", "attach"]


class Observer(Protocol):
    def on_loss(self, loss: torch.Tensor, scale: float) -> None: ...

    def on_step(self, skipped: bool) -> None: ...

    def close(self) -> None: ...


# (session, models, path, eps_lost) -> the diagnose recorder, an Observer (`ampatch.record.child.attach`)
RecorderFactory = Callable[[Any, Sequence[nn.Module], str, Sequence[str]], Observer]


class StopAfter:
    """Ends the process (`SystemExit(0)`) after `steps` optimizer steps, skipped ones included:
    a command needs no more of the run (`ampatch compare`, `ampatch diagnose`)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.seen = steps, 0

    def on_loss(self, loss: torch.Tensor, scale: float) -> None:
        pass

    def on_step(self, skipped: bool) -> None:
        self.seen += 1
        if self.seen >= self.steps:
            logger.info("ampatch: %s=%d: ending the process after %d optimizer steps.", MAX_STEPS, self.steps,
                        self.seen)
            raise SystemExit(0)

    def close(self) -> None:
        pass


class ReportAtExit:
    """The session's `report()` written as JSON to `path` at exit (`telemetry.exit_report`:
    the newest session of the process writes; a closed one leaves what it would write).

    A session opened without optimizers (evaluation after training: a framework's
    validate/test stage, a model initialized again for inference) does not take the report
    over from an earlier session of the process, whose steps are what `ampatch run/compare/
    tune` measure; it takes it over at its first optimizer step (`amp.init()` adds them later)."""

    def __init__(self, session: Any, path: str) -> None:
        self.session, self.path = session, path
        trains = bool(session.optimizers) if hasattr(session, "optimizers") else True
        self.tracking = trains or not exit_report.holds_source()
        if self.tracking:
            exit_report.track(session, path)

    def on_loss(self, loss: torch.Tensor, scale: float) -> None:
        pass

    def on_step(self, skipped: bool) -> None:
        if not self.tracking:
            self.tracking = True
            exit_report.track(self.session, self.path)

    def close(self) -> None:
        exit_report.release(self.session)


def attach(session: Any, models: Sequence[nn.Module], overrides: Overrides, recorder: RecorderFactory | None = None,
           eps_lost: Sequence[str] = ()) -> list[Observer]:
    """Attach the observers `overrides` ask for to `session.observers`, in the order they are
    told of each step; each is there as soon as it exists, so that `Session.close` releases it
    even when a later one fails to attach. `eps_lost`: `hardware.eps_lost_in_float16`'s findings."""
    observers: list[Observer] = session.observers
    for path, variable in ((overrides.report, REPORT), (overrides.diagnose, DIAGNOSE), (overrides.witness, WITNESS)):
        if path:
            check_writable(path, variable)
    if overrides.report:
        observers.append(ReportAtExit(session, overrides.report))
    if overrides.witness:  # the weights as a second witness of a run's learning (tune, compare, diagnose)
        observers.append(WeightWitness(session, overrides.witness))
    if overrides.diagnose:  # per-module statistics for `ampatch diagnose`
        if recorder is None:
            raise OrderError(f"{DIAGNOSE} is set, but this session was opened without a recorder; open it through "
                             "amp.initialize.")
        observers.append(recorder(session, models, overrides.diagnose, eps_lost))
    if overrides.max_steps is not None:
        observers.append(StopAfter(overrides.max_steps))
    return observers
