"""`ampatch diagnose`: run a training script (or a built-in workload) for a few steps with the
recorder on, analyse it, and verify the recommendation by running again with it.

The runs are child processes like `ampatch compare`'s (`runs.runner.run_child`), each
stopped after the same number of optimizer steps (``AMPATCH_MAX_STEPS``), with the same seed
(a script's own, a workload's ``--seed``):

1. the diagnosed run: at the chosen level, recording (``AMPATCH_DIAGNOSE``) and reporting
   (``AMPATCH_REPORT``); recording does not change the numbers, so its report is also the
   "without the fix" figures;
2. O0, the reference of every loss curve;
3. the run with the recommendation (``AMPATCH_KEEP_FP32``, and ``AMPATCH_LOSS_SCALE`` for a
   setting), recording too: while it is still not finite, the set grows by its first
   non-finite module (or the parent of the last module added) and is verified again, at most
   `MAX_ROUNDS` times; then the diagnosis says plainly that it gave up.
"""
from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from ..config import env
from ..compare.rows import Row
from ..record.child import DEFAULT_STEPS, FORMAT
from ..runs.runner import Finished, LevelRun, child_env, failure_line, level_run, run_child, with_apex_alias
from .analysis import diagnosis, grow

__all__ = ["Request", "RunFailed", "diagnose", "MAX_ROUNDS"]

MAX_ROUNDS = 3  # verification runs that may grow the set before giving up


class RunFailed(RuntimeError):
    """The diagnosed run could not be diagnosed (it crashed first, or never trained under
    amp): the message says why, for the command line to print."""


@dataclass(frozen=True)
class Request:
    """What to diagnose: a command line (a user script, or a built-in workload's), the level
    (None: the script's own), the half dtype (None: auto), the steps, the Apex alias."""

    command: Sequence[str]
    level: str | None
    half_dtype: str | None
    steps: int = DEFAULT_STEPS
    apex_alias: bool = False
    keep_fp32: tuple[str, ...] = ()  # kept already (the user's --keep-fp32): diagnosed with them


@dataclass(frozen=True)
class _Run:
    """One child run: what it left, its report or why it failed, and what it recorded (None
    without AMPATCH_DIAGNOSE)."""

    finished: Finished
    run: LevelRun
    diagnosis: dict[str, Any] | None


def _run(req: Request, log: TextIO, what: str, level: str | None, keep: Sequence[str] = (),
         settings: dict[str, Any] | None = None, record: bool = True) -> _Run:
    log.write(f"ampatch diagnose: {what} ...\n")
    log.flush()
    variables = child_env(level, req.half_dtype)
    variables[env.MAX_STEPS] = str(req.steps)
    for name in (env.KEEP_FP32, env.LOSS_SCALE, env.DIAGNOSE, env.REPORT):
        variables.pop(name, None)
    if keep:
        variables[env.KEEP_FP32] = ",".join(keep)
    if settings and "loss_scale" in settings:
        variables[env.LOSS_SCALE] = str(settings["loss_scale"])
    if req.apex_alias:
        variables = with_apex_alias(variables)
    collect = (env.REPORT, env.DIAGNOSE) if record else (env.REPORT,)
    done = run_child(list(req.command), variables, collect=collect)
    return _Run(done, level_run(done, level), done.outputs.get(env.DIAGNOSE))


def _figures(run: _Run, baseline: Row | None, keep: Sequence[str], settings: dict[str, Any]) -> dict[str, Any]:
    """{"keep_fp32", "settings", "finite", "final_loss", "max_dev_vs_O0", ...} of one run."""
    row = Row.of(run.run, baseline)
    level = row.level
    losses = row.losses
    skipped = row.skipped_steps
    steps = row.steps or 0
    finite = (row.ok and bool(losses) and all(math.isfinite(x) for x in losses)
              and not (steps and (steps - 1) in skipped))
    return {"keep_fp32": list(keep), "settings": dict(settings), "level": level, "finite": finite,
            "final_loss": _number(row.final_loss), "max_dev_vs_O0": _number(row.max_loss_dev_vs_O0),
            "skipped_steps": len(skipped), "steps": steps, "error": row.error}


def _number(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _grow(keep: list[str], run: _Run) -> str | None:
    """The module to add after a verification run that is still not finite (`analysis.grow`)."""
    return grow(keep, diagnosis(run.diagnosis) if run.diagnosis else None)


def diagnose(req: Request, log: TextIO = sys.stderr) -> dict[str, Any]:
    """The whole diagnosis (see the module docstring) as JSON-ready data. Raises `RunFailed`
    when the diagnosed run gives nothing to analyse."""
    where = req.level or "the script's own level"
    first = _run(req, log, f"recording {req.steps} steps at {where}", req.level,
                 keep=req.keep_fp32)
    doc = first.diagnosis
    if doc is None:
        crashed = failure_line(first.finished.returncode, first.finished.stderr)
        why = crashed or "it ended without calling amp.initialize"
        if first.finished.returncode == 0 and first.run.report is not None:
            why = "it called amp.initialize but never completed an optimizer step after amp.scale_loss"
        raise RunFailed(f"nothing to diagnose: {why}.\n{_tail(first.finished.stderr)}".rstrip())
    if doc.get("format") != FORMAT:
        raise RunFailed(f"the run wrote a diagnosis of format {doc.get('format')!r}; this ampatch reads {FORMAT}.")
    found = diagnosis(doc)
    steps = doc.get("recorded", {}).get("steps") or []
    if not steps:
        raise RunFailed("nothing to diagnose: the script never completed an optimizer step after amp.scale_loss "
                        "under amp.initialize." + (f" It failed: {first.run.error}" if first.run.error else ""))
    if all(s.get("loss") is None for s in steps):
        raise RunFailed("nothing to diagnose: the script stepped its optimizer but never completed an optimizer "
                        "step after amp.scale_loss: the loss's backward must run inside `with "
                        "amp.scale_loss(loss, optimizer) as scaled: scaled.backward()` for ampatch to see it.")
    result = {**found.to_dict(), "opt_level": doc.get("opt_level"), "kept_already": list(req.keep_fp32),
              "crashed": first.run.error, "verification": None}
    rec = result["recommendation"]
    if not found.keep_fp32 and not found.settings:
        return result
    baseline_run = _run(req, log, "the O0 reference", "O0", record=False)
    baseline = Row.of(baseline_run.run)
    keep = list(req.keep_fp32) + [k for k in found.keep_fp32 if k not in req.keep_fp32]
    settings = dict(found.settings)
    tries = []
    for _ in range(MAX_ROUNDS):
        run = _run(req, log, f"verifying keep_fp32={keep}" + (f" with {settings}" if settings else ""),
                   req.level, keep=keep, settings=settings)
        figures = _figures(run, baseline, keep, settings)
        tries.append(figures)
        if figures["finite"] or figures["error"]:
            break
        grown = _grow(keep, run)
        if grown is None:
            break
        keep = keep + [grown]
    verified = tries[-1]
    gave_up = not verified["finite"]
    result["recommendation"] = {**rec, "keep_fp32": verified["keep_fp32"]}
    result["verification"] = {
        **verified,
        "without": _figures(first, baseline, req.keep_fp32, {}),
        "O0": _figures(baseline_run, baseline, [], {}),
        "tries": tries,
        "gave_up": gave_up,
    }
    if gave_up:
        result["recommendation"]["notes"].append(
            f"gave up: after {len(tries)} verification run(s) the run is still not finite with "
            f"keep_fp32={verified['keep_fp32']}" + (f" ({verified['error']})" if verified["error"] else "")
            + ". The cause may not be a module's precision (a learning rate, the data), or it needs FP32 "
              "for more of the model than this search tried.")
    return result


def _tail(stderr: str, lines: int = 12) -> str:
    """The last lines of a run's stderr, indented, for a failure message."""
    kept = [ln for ln in stderr.splitlines() if ln.strip()][-lines:]
    return "\n".join("    " + ln for ln in kept)
