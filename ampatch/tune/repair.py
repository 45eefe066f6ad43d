"""A failed candidate's repair: one recorded run (the `diagnose` recorder), and the candidate
its diagnosis suggests: its `keep_fp32` added, its loss scale (dynamic against gradient
underflow). A diagnosis that names a step fault (the optimizer's own arithmetic, not a
module's precision) gives no repair: the candidate is dropped with that reason. While a
repair still fails, the set grows as `ampatch diagnose` grows it (the new first non-finite
module, else the parent of the last module added), within `MAX_REPAIRS` tries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TextIO

from ampatch.config import env
from ampatch.diagnose.analysis import Diagnosis, diagnosis, grow
from ampatch.record.child import FORMAT
from ampatch.tune.candidates import Candidate
from ampatch.tune.measure import Job, run_candidate

__all__ = ["Suggestion", "suggest", "MAX_REPAIRS"]

MAX_REPAIRS = 2   # repaired runs per failed candidate (each after one recorded run)


@dataclass(frozen=True)
class Suggestion:
    """What a recorded run suggests: the next candidate, or why there is none."""

    candidate: Candidate | None
    why: str
    step_fault: bool = False


def _record(candidate: Candidate, job: Job, log: TextIO | None) -> Diagnosis | None:
    done = run_candidate(candidate, job, log, record=True)
    doc = done.outputs.get(env.DIAGNOSE)
    if not doc or doc.get("format") != FORMAT:
        return None
    return diagnosis(doc)


def suggest(candidate: Candidate, job: Job, log: TextIO | None) -> Suggestion:
    """Record `candidate`'s run and read what would repair it."""
    found = _record(candidate, job, log)
    if found is None:
        return Suggestion(None, "its recorded run gave nothing to diagnose")
    if found.step_fault is not None:
        return Suggestion(None, found.step_fault.note, step_fault=True)
    keep = [k for k in found.keep_fp32 if k not in candidate.keep_fp32]
    if not keep and found.first_nonfinite is not None and candidate.keep_fp32:
        grown = grow(candidate.keep_fp32, found)  # diagnose's own rule for a kept set that did not help
        keep = [grown] if grown is not None else []
    scale = found.settings.get("loss_scale")
    if not keep and (scale is None or scale == candidate.loss_scale):
        return Suggestion(None, "the diagnosis names no module to keep in FP32 and no setting")
    why = "; ".join(found.notes[:2]) or f"keep {keep} in FP32"
    return Suggestion(candidate.repaired(keep, scale), why)
