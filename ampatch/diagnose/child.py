"""The diagnosed run's side: `Session.setup` calls `attach` when ``AMPATCH_DIAGNOSE=PATH`` is
set (by `ampatch diagnose`, or by hand), and PATH receives the recorded statistics as JSON,
once the recording's steps are done, or at exit with what was recorded so far.

The recording lasts ``AMPATCH_MAX_STEPS`` optimizer steps when that is set (the session then
ends the process: the diagnosis needs no more of the training), else `DEFAULT_STEPS`. As with
``AMPATCH_REPORT``, the newest session of the process writes, and under torchrun rank 0 only.
"""
from __future__ import annotations

import atexit
import json
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .. import fsdp, tips
from ..dtypes import short_name
from ..telemetry import process_rank
from .recorder import Recorder

logger = logging.getLogger("ampatch")

__all__ = ["attach", "DEFAULT_STEPS", "FORMAT"]

DEFAULT_STEPS = 8  # optimizer steps recorded when AMPATCH_MAX_STEPS does not say
FORMAT = 1         # the version of the JSON written (`ampatch diagnose` checks it)


class _Output:
    """Where the newest recording goes, and the one exit hook that writes it."""

    recorder: Recorder | None = None
    path = ""
    meta: dict[str, Any] = {}
    written = False
    registered = False

    @classmethod
    def track(cls, recorder: Recorder, path: str, meta: dict[str, Any]) -> None:
        cls.recorder, cls.path, cls.meta, cls.written = recorder, path, meta, False
        if not cls.registered:
            atexit.register(cls.write)
            cls.registered = True

    @classmethod
    def write(cls, recorder: Recorder | None = None) -> None:
        """Write the newest recording (`recorder`: only if it is that one); at most once."""
        rec = cls.recorder
        if rec is None or (recorder is not None and recorder is not rec) or cls.written:
            return
        if process_rank() != 0:
            return
        try:
            data = {"format": FORMAT, **cls.meta, "complete": len(rec.steps) >= rec.steps_wanted,
                    "recorded": rec.result()}
            with open(cls.path, "w") as f:
                json.dump(data, f)
            cls.written = True
        except Exception:  # at exit or inside a step: say why, never fail the run for it
            logger.exception("ampatch: could not write the diagnosis to %s", cls.path)


def _masters(session: Any) -> dict[int, torch.Tensor]:
    """id(half model param) -> its FP32 master, over the session's optimizers (O2/O5)."""
    found: dict[int, torch.Tensor] = {}
    for h in session.optimizers:
        for mp, master in h.pairs():
            found[id(mp)] = master
    return found


def attach(session: Any, models: Sequence[nn.Module], path: str) -> Recorder:
    """Start recording `models` of `session` for `ampatch diagnose`; returns the recorder,
    which the session feeds its losses and steps (`on_loss`, `on_step`) and closes."""
    props = session.properties
    masters = _masters(session)
    sharded = fsdp.is_sharded(models)
    recorder = Recorder(models, props.half_dtype, session.stop_after or DEFAULT_STEPS,
                        masters=lambda p: masters.get(id(p)), shadows=not sharded,
                        on_done=lambda r: _Output.write(r))
    notes = [f"{line}: float16 rounds that eps to 0; with float16 parameters stepped in float16, any weight "
             "whose gradient is 0 becomes NaN. Use O2 (FP32 masters), bfloat16, or eps=1e-4."
             for line in tips.eps_lost_in_float16([h.optimizer for h in session.optimizers])]
    if sharded:
        notes.append("FSDP-sharded model: no FP32 shadows (local errors are not measured); inf/NaN and "
                     "underflow are.")
    meta = {"opt_level": props.opt_level, "half_dtype": short_name(props.half_dtype) if props.opt_level != "O0"
            else None, "loss_scale": props.loss_scale, "notes": notes,
            "keep_fp32": [k.label for k in session.kept]}
    _Output.track(recorder, path, meta)
    recorder.attach()
    logger.info("ampatch: diagnosing %d modules for %d optimizer steps (%s)", len(recorder.names),
                recorder.steps_wanted, path)
    return recorder
