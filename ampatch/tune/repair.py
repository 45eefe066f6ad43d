"""A failed candidate's repair: one recorded run (the `diagnose` recorder), and the candidate
its diagnosis suggests: its `keep_fp32` added, its settings (a dynamic loss scale against
gradient underflow; FP32 master weights against stalled updates, weights the optimizer's steps
leave unchanged), and for an FP8 candidate the layers FP8 hurts left out of FP8
(`fp8_modules`). A diagnosis that names a step fault (the optimizer's own arithmetic, not a
module's precision) recommends FP32 masters, as `diagnose` does, and no module: the repair is
the candidate with FP32 masters. While a repair still fails, the set grows as `ampatch
diagnose` grows it (the new first non-finite module, else the parent of the last module
added; never after a step fault), within `MAX_REPAIRS` tries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from ampatch.config import env
from ampatch.diagnose.analysis import diagnosis, grow
from ampatch.diagnose.result import Diagnosis
from ampatch.record.records import RecordingError
from ampatch.tune.candidates import Candidate
from ampatch.tune.measure import Job, run_candidate

__all__ = ["Suggestion", "suggest", "MAX_REPAIRS"]

MAX_REPAIRS = 2   # repaired runs per failed candidate (each after one recorded run)


@dataclass(frozen=True)
class Suggestion:
    """What a recorded run suggests: the next candidate, or why there is none; `finding`: what
    the failed candidate's reason gains (a step fault, stalled updates), None for nothing."""

    candidate: Candidate | None
    why: str
    step_fault: bool = False
    finding: str | None = None


def _record(candidate: Candidate, job: Job, log: TextIO | None) -> Diagnosis | None:
    done = run_candidate(candidate, job, log, record=True)
    doc = done.outputs.get(env.DIAGNOSE)
    try:
        return diagnosis(doc) if doc else None
    except RecordingError:
        return None


def suggest(candidate: Candidate, job: Job, log: TextIO | None) -> Suggestion:
    """Record `candidate`'s run and read what would repair it."""
    found = _record(candidate, job, log)
    if found is None:
        return Suggestion(None, "its recorded run gave nothing to diagnose")
    fault = found.step_fault
    if fault is not None and (not found.recommendation.settings.master_weights or candidate.master_weights):
        return Suggestion(None, fault.note, step_fault=True, finding=fault.note)
    stall = found.stall if found.stall is not None and found.stall.finding else None
    finding = None if stall is None else (
        f"stalled updates: {stall.unchanged:.0%} of the weights unchanged by each optimizer step ({stall.held_in} "
        "weights below their resolution, no FP32 masters)")
    rec = found.recommendation
    keep = [k for k in rec.keep_fp32 if k not in candidate.keep_fp32]
    if not keep and found.first_nonfinite is not None and candidate.keep_fp32:
        grown = grow(candidate.keep_fp32, found)  # diagnose's own rule for a kept set that did not help
        keep = [grown] if grown is not None else []
    scale, masters = rec.settings.loss_scale, rec.settings.master_weights
    new_scale = scale is not None and scale != candidate.loss_scale
    new_masters = masters is not None and masters != candidate.master_weights
    exclude = [e for e in rec.fp8_exclude if e not in candidate.fp8_exclude] if candidate.fp8 else []
    if exclude and not rec.fp8_modules:
        return Suggestion(None, f"FP8 hurts every layer it ran ({', '.join(exclude)}): the level without fp8 is a "
                                "candidate of its own", finding=finding)
    if not keep and not new_scale and not new_masters and not exclude:
        return Suggestion(None, "the diagnosis names no module to keep in FP32, no layer to leave out of FP8 and no "
                                "setting", finding=finding)
    if fault is not None:
        return Suggestion(candidate.repaired([], scale, masters), f"{fault.note.split(':')[0]}: FP32 master weights",
                          step_fault=True, finding=fault.note)
    if stall is not None:
        why = f"{finding}: FP32 master weights"
    elif exclude and not keep and not new_scale:
        why = next((n for n in rec.notes if n.startswith(f"fp8: {exclude[0]} (")), f"leave {exclude} out of FP8")
    else:
        why = "; ".join(rec.notes[:2]) or f"keep {keep} in FP32"
    return Suggestion(candidate.repaired(keep, scale, masters, exclude, rec.fp8_modules), why, finding=finding)
