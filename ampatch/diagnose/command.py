"""`ampatch diagnose` as a library call: run a training script (or a built-in workload) for a
few steps with the recorder on, diagnose it, and verify the recommendation by running again
with it. `diagnose(Request(...))` returns the typed `Diagnosis`; the command line prints it.

The runs are child processes like `ampatch compare`'s (`runs.runner.run_child`), each
stopped after the same number of optimizer steps (``AMPATCH_MAX_STEPS``), with the same seed
(a script's own, a workload's ``--seed``):

1. the diagnosed run: at the chosen level, recording (``AMPATCH_DIAGNOSE``) and reporting
   (``AMPATCH_REPORT``); recording does not change the numbers, so its report is also the
   "without the fix" figures;
2. O0, the reference of every loss curve;
3. the run with the recommendation (``AMPATCH_KEEP_FP32``, ``AMPATCH_LOSS_SCALE`` and
   ``AMPATCH_MASTER_WEIGHTS`` for the settings, ``AMPATCH_FP8_MODULES`` for the layers left in
   FP8 once those FP8 hurts are left out), recording too: while it is still not finite,
   the set grows by its first non-finite module (or the parent of the last module added) and
   is verified again, at most `MAX_ROUNDS` times; then the diagnosis says plainly that it gave
   up. Each run is judged against O0 by the rule ``tune`` holds a candidate to
   (`ampatch.runs.verdict.judge` at `TOLERANCE`: learning like O0 at 99% confidence, its
   deviation from O0's curve within the tolerance beyond its own noise; `Figures.follows_O0`):
   a fix for stalled updates is verified by the loss following O0 again.

With `Request.fp8` the diagnosed run and its reruns run the Linear layers in FP8
(``AMPATCH_FP8``); O0 never does.
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

from ..config import env
from ..errors import RunFailed
from ..record.child import DEFAULT_STEPS
from ..record.records import Recording, RecordingError
from ..runs.deviation import TOLERANCE, Basis
from ..runs.longer import DEFAULT_BUDGET_S, Longer
from ..runs.runner import COLLECT, Finished, LevelRun, child_env, failure_line, level_run, run_child, with_apex_alias
from ..runs.stats import RunStats
from ..runs.verdict import Rule, judge
from .analysis import diagnosis, grow
from .result import Diagnosis, Figures, Recommendation, Settings, Verification

__all__ = ["Request", "RunFailed", "diagnose", "MAX_ROUNDS"]

MAX_ROUNDS = 3  # verification runs that may grow the set before giving up


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
    fp8: str | None = None           # a recipe: the Linear layers in FP8 (AMPATCH_FP8; None: as the script says)
    budget: float | None = DEFAULT_BUDGET_S  # seconds for verification runs made longer (None: no limit)


@dataclass(frozen=True)
class _Run:
    """One child run: what it left, its report or why it failed, and what it recorded (None
    without AMPATCH_DIAGNOSE)."""

    finished: Finished
    run: LevelRun
    recording: dict[str, Any] | None


def _run(req: Request, log: TextIO, what: str, level: str | None, keep: Sequence[str] = (),
         settings: Settings | None = None, record: bool = True, fp8_modules: Sequence[str] | None = None) -> _Run:
    """One child run at `level` ("O0": the reference, never in FP8), with `keep` in FP32,
    `settings` (None: none changed), and only `fp8_modules` in FP8 (None: the layers the run
    chooses; none: fp8 off)."""
    settings = settings if settings is not None else Settings()
    log.write(f"ampatch diagnose: {what} ...\n")
    log.flush()
    variables = child_env(level, req.half_dtype, max_steps=req.steps)
    for name in (env.KEEP_FP32, env.LOSS_SCALE, env.MASTER_WEIGHTS, env.DIAGNOSE, env.REPORT, env.FP8_MODULES):
        variables.pop(name, None)
    if level == "O0":
        variables[env.FP8] = "off"  # the FP32 reference, whatever the script or the shell says
    elif req.fp8 is not None:
        variables[env.FP8] = req.fp8
    if fp8_modules is not None:
        if fp8_modules:
            variables[env.FP8_MODULES] = ",".join(fp8_modules)
        else:
            variables[env.FP8] = "off"
    if keep:
        variables[env.KEEP_FP32] = ",".join(keep)
    if settings.loss_scale is not None:
        variables[env.LOSS_SCALE] = str(settings.loss_scale)
    if settings.master_weights is not None:
        variables[env.MASTER_WEIGHTS] = str(settings.master_weights)
    if req.apex_alias:
        variables = with_apex_alias(variables)
    collect = (*COLLECT, env.DIAGNOSE) if record else COLLECT
    done = run_child(list(req.command), variables, collect=collect)
    return _Run(done, level_run(done, level), done.outputs.get(env.DIAGNOSE))


def _number(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _figures(run: _Run, baseline: RunStats | None, keep: Sequence[str], settings: Settings,
             fp8_exclude: Sequence[str] = ()) -> Figures:
    """One run's figures against O0's `baseline` row (None: it is O0's own)."""
    row = RunStats.of(run.run, baseline)
    losses, skipped, steps = row.losses, row.skipped_steps, row.steps or 0
    finite = (row.ok and bool(losses) and all(math.isfinite(x) for x in losses)
              and not (steps and (steps - 1) in skipped))
    dev, share = _number(row.max_loss_dev_vs_O0), row.learned_vs_O0
    follows, why = None, ""
    if baseline is not None:
        verdict = judge(row, Rule(TOLERANCE), baseline.reference(), o0_witness=baseline.witness)
        follows, why = (verdict.qualifies if verdict.judged else None), verdict.reason
    return Figures(tuple(keep), settings, row.level, finite, _number(row.final_loss), dev, share, follows,
                   len(skipped), steps, row.error, tuple(fp8_exclude), why)


def _grow(keep: list[str], run: _Run) -> str | None:
    """The module to add after a verification run that is still not finite (`analysis.grow`)."""
    try:
        return grow(keep, diagnosis(run.recording) if run.recording else None)
    except RecordingError:
        return grow(keep, None)


def _recorded(first: _Run) -> Diagnosis:
    """The diagnosis of the recorded run; `RunFailed` when it gives nothing to diagnose."""
    doc = first.recording
    if doc is None:
        crashed = failure_line(first.finished.returncode, first.finished.stderr)
        why = crashed or "it ended without calling amp.initialize"
        if first.finished.returncode == 0 and first.run.report is not None:
            why = "it called amp.initialize but never completed an optimizer step after amp.scale_loss"
        raise RunFailed(f"nothing to diagnose: {why}.\n{_tail(first.finished.stderr)}".rstrip())
    try:
        recording = Recording.from_dict(doc)
    except RecordingError as exc:
        raise RunFailed(f"{exc}.") from None
    if not recording.steps:
        raise RunFailed("nothing to diagnose: the script never completed an optimizer step after amp.scale_loss "
                        "under amp.initialize." + (f" It failed: {first.run.error}" if first.run.error else ""))
    if all(s.loss is None for s in recording.steps):
        raise RunFailed("nothing to diagnose: the script stepped its optimizer but never completed an optimizer "
                        "step after amp.scale_loss: the loss's backward must run inside `with "
                        "amp.scale_loss(loss, optimizer) as scaled: scaled.backward()` for ampatch to see it.")
    return diagnosis(recording)


def diagnose(req: Request, log: TextIO = sys.stderr) -> Diagnosis:
    """The whole diagnosis (see the module docstring), verified when it recommends a change.
    Raises `RunFailed` when the diagnosed run gives nothing to analyse."""
    started = time.time()
    where = req.level or "the script's own level"
    first = _run(req, log, f"recording {req.steps} steps at {where}", req.level, keep=req.keep_fp32)
    found = replace(_recorded(first), kept_already=tuple(req.keep_fp32), crashed=first.run.error)
    rec = found.recommendation
    if not rec:
        return found
    baseline_run = _run(req, log, "the O0 reference", "O0", record=False)
    baseline = RunStats.of(baseline_run.run)
    keep = list(req.keep_fp32) + [k for k in rec.keep_fp32 if k not in req.keep_fp32]
    tries: list[Figures] = []
    for _ in range(MAX_ROUNDS):
        run = _run(req, log, f"verifying {_what(keep, rec)}", req.level, keep=keep, settings=rec.settings,
                   fp8_modules=rec.fp8_modules)
        figures = _figures(run, baseline, keep, rec.settings, rec.fp8_exclude)
        tries.append(figures)
        if figures.finite or figures.error:
            break
        grown = _grow(keep, run)
        if grown is None:
            break
        keep = keep + [grown]
    verified, at_first = tries[-1], baseline   # the diagnosed run is judged at its own steps
    longer = Longer(req.steps, req.steps, None if req.budget is None else started + req.budget)
    longer.saw(req.steps, baseline.steps)
    while verified.finite and verified.follows_O0 is None and longer.why_not(2, run.finished.wall_s) is None:
        steps = longer.double()  # the runs cannot tell yet: O0 and the fix again, twice as long (runs.longer)
        at = replace(req, steps=steps)
        baseline_run = _run(at, log, f"the O0 reference, {steps} steps", "O0", record=False)
        baseline = RunStats.of(baseline_run.run)
        longer.saw(steps, baseline.steps)
        run = _run(at, log, f"verifying {_what(keep, rec)}, {steps} steps", req.level, keep=keep,
                   settings=rec.settings, fp8_modules=rec.fp8_modules, record=False)
        verified = _figures(run, baseline, keep, rec.settings, rec.fp8_exclude)
        tries.append(verified)
    basis = baseline.reference()
    verification = Verification(verified, _figures(first, at_first, req.keep_fp32, Settings()),
                                _figures(baseline_run, None, (), Settings()), tuple(tries), gave_up=not verified.finite,
                                o0_progress=basis.progress if basis.basis is Basis.PROGRESS else None)
    found = replace(found, recommendation=replace(rec, keep_fp32=verified.keep_fp32), verification=verification)
    if verification.gave_up:
        found = found.with_notes(
            f"gave up: after {len(tries)} verification run(s) the run is still not finite with "
            f"keep_fp32={list(verified.keep_fp32)}" + (f" ({verified.error})" if verified.error else "")
            + ". The cause may not be a module's precision (a learning rate, the data), or it needs FP32 "
              "for more of the model than this search tried.")
    return found


def _what(keep: Sequence[str], rec: Recommendation) -> str:
    """The fix a verification run tries, in words."""
    return ", ".join([f"keep_fp32={list(keep)}"] * bool(keep) + [f"{rec.settings.to_dict()}"] * bool(rec.settings)
                     + [f"{list(rec.fp8_exclude)} out of FP8"] * bool(rec.fp8_exclude))


def _tail(stderr: str, lines: int = 12) -> str:
    """The last lines of a run's stderr, indented, for a failure message."""
    kept = [ln for ln in stderr.splitlines() if ln.strip()][-lines:]
    return "\n".join("    " + ln for ln in kept)
