"""The diagnosed run's side: the session calls `attach` (handed to it by the public API)
when ``AMPATCH_DIAGNOSE=PATH`` is set (by `ampatch diagnose`, or by hand), and PATH receives
the `Recording` as JSON, once the recording's steps are done, or at exit with what was
recorded so far.

The recording lasts ``AMPATCH_MAX_STEPS`` optimizer steps when that is set (the session then
ends the process: the diagnosis needs no more of the training), else `DEFAULT_STEPS`. As with
``AMPATCH_REPORT``, the newest session of the process writes, and under torchrun rank 0 only.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..base.exit_json import ExitJson
from ..model.cast import is_sharded
from .fp8_probe import probe
from .recorder import Recorder
from .records import FORMAT, Recording

logger = logging.getLogger("ampatch")

__all__ = ["attach", "DEFAULT_STEPS", "FORMAT"]

DEFAULT_STEPS = 8  # optimizer steps recorded when AMPATCH_MAX_STEPS does not say


@dataclass(frozen=True)
class _Setup:
    """How the session was set up: what the recording's document says besides the records."""

    opt_level: str
    half_dtype: str | None
    loss_scale: float | str
    master_weights: str
    notes: list[str]
    keep_fp32: list[str]
    eps_lost: list[str]


def _document(tracked: tuple[Recorder, _Setup]) -> dict[str, Any]:
    """The JSON `ampatch diagnose` reads (`Recording.to_dict`)."""
    rec, setup = tracked
    return Recording(setup.opt_level, setup.half_dtype, setup.loss_scale, setup.master_weights, setup.notes,
                     setup.keep_fp32, complete=len(rec.steps) >= rec.steps_wanted, steps_wanted=rec.steps_wanted,
                     steps=list(rec.steps), modules=[rec.records[name] for name, _ in rec.names],
                     params=rec.stalls.records, fp8=rec.fp8.result() if rec.fp8 is not None else [],
                     eps_lost=setup.eps_lost).to_dict()


_output = ExitJson(_document, "diagnosis")  # the newest recording, written when it ends or at exit


def _masters(session: Any) -> dict[int, torch.Tensor]:
    """id(half model param) -> its FP32 master, over the session's optimizers (O2/O5)."""
    found: dict[int, torch.Tensor] = {}
    for h in session.optimizers:
        for mp, master in h.pairs():
            found[id(mp)] = master
    return found


def attach(session: Any, models: Sequence[nn.Module], path: str, eps_lost: Sequence[str] = ()) -> Recorder:
    """Start recording `models` of `session` for `ampatch diagnose`; returns the recorder,
    which the session feeds its losses and steps (`on_loss`, `on_step`) and closes. `eps_lost`:
    the optimizers whose Adam eps float16 rounds to 0 (`hardware.eps_lost_in_float16`)."""
    props = session.properties
    masters = _masters(session)
    sharded = is_sharded(models)
    recorder = Recorder(models, props.half_dtype, session.overrides.max_steps or DEFAULT_STEPS,
                        masters=lambda p: masters.get(id(p)), shadows=not sharded,
                        on_done=lambda r: _output.write(tracked), fp8=probe(getattr(session, "fp8", None)))
    notes = [f"{line}: float16 rounds that eps to 0; with float16 parameters stepped in float16, any weight "
             "whose gradient is 0 becomes NaN. Use O2 (FP32 masters), bfloat16, or eps=1e-4."
             for line in eps_lost]  # (what the session found with hardware.eps_lost_in_float16)
    if sharded:
        notes.append("FSDP-sharded model: no FP32 shadows (local errors are not measured); inf/NaN and "
                     "underflow are.")
    setup = _Setup(props.opt_level, props.half_name, props.loss_scale, props.master_mode.value, notes,
                   [k.label for k in session.kept], list(eps_lost))
    tracked = (recorder, setup)
    _output.track(tracked, path)
    recorder.attach()
    logger.info("ampatch: diagnosing %d modules for %d optimizer steps (%s)", len(recorder.names),
                recorder.steps_wanted, path)
    return recorder
