"""The diagnosed run's side: `Session.setup` calls `attach` when ``AMPATCH_DIAGNOSE=PATH`` is
set (by `ampatch diagnose`, or by hand), and PATH receives the recorded statistics as JSON,
once the recording's steps are done, or at exit with what was recorded so far.

The recording lasts ``AMPATCH_MAX_STEPS`` optimizer steps when that is set (the session then
ends the process: the diagnosis needs no more of the training), else `DEFAULT_STEPS`. As with
``AMPATCH_REPORT``, the newest session of the process writes, and under torchrun rank 0 only.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..session import fsdp
from ..session.exit_json import ExitJson
from .recorder import Recorder

logger = logging.getLogger("ampatch")

__all__ = ["attach", "DEFAULT_STEPS", "FORMAT"]

DEFAULT_STEPS = 8  # optimizer steps recorded when AMPATCH_MAX_STEPS does not say
FORMAT = 1         # the version of the JSON written (`ampatch diagnose` checks it)


def _diagnosis(tracked: tuple[Recorder, dict[str, Any]]) -> dict[str, Any]:
    """The JSON `ampatch diagnose` reads: the recording with what the session was set up as."""
    rec, meta = tracked
    return {"format": FORMAT, **meta, "complete": len(rec.steps) >= rec.steps_wanted, "recorded": rec.result()}


_output = ExitJson(_diagnosis, "diagnosis")  # the newest recording, written when it ends or at exit


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
    the optimizers whose Adam eps float16 rounds to 0 (`tips.eps_lost_in_float16`)."""
    props = session.properties
    masters = _masters(session)
    sharded = fsdp.is_sharded(models)
    recorder = Recorder(models, props.half_dtype, session.overrides.max_steps or DEFAULT_STEPS,
                        masters=lambda p: masters.get(id(p)), shadows=not sharded,
                        on_done=lambda r: _output.write(tracked))
    notes = [f"{line}: float16 rounds that eps to 0; with float16 parameters stepped in float16, any weight "
             "whose gradient is 0 becomes NaN. Use O2 (FP32 masters), bfloat16, or eps=1e-4."
             for line in eps_lost]  # (what Session.setup found with tips.eps_lost_in_float16)
    if sharded:
        notes.append("FSDP-sharded model: no FP32 shadows (local errors are not measured); inf/NaN and "
                     "underflow are.")
    meta = {"opt_level": props.opt_level, "half_dtype": props.half_name, "loss_scale": props.loss_scale, "notes": notes,
            "keep_fp32": [k.label for k in session.kept]}
    tracked = (recorder, meta)
    _output.track(tracked, path)
    recorder.attach()
    logger.info("ampatch: diagnosing %d modules for %d optimizer steps (%s)", len(recorder.names),
                recorder.steps_wanted, path)
    return recorder
