"""The statistics of one run, computed from its report against O0's: what `compare` shows
as a row, `tune` judges and `diagnose` verifies with.

A `RunStats` is built once from a `LevelRun` (and the baseline's) and never changed: median
step time (warm-up skipped), speed-up over O0, first and final loss, the deviation of the loss
curve from O0's and the share of O0's progress it makes (`ampatch.runs.deviation`: relative to
what O0 learns over the run, the loss scaler's initial back-offs shifted out), peak memory,
skipped steps and the final loss scale.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ampatch.runs.deviation import Reference, deviation, learned, losses_per_step
from ampatch.runs.runner import LevelRun
from ampatch.session.report import Report

WARMUP_FRACTION = 0.2    # share of step times skipped before the median
FINAL_LOSS_WINDOW = 5    # "final loss" is the mean of this many last losses
BASELINE = "O0"          # the level every other is compared with
# what a run without a report (it failed before amp.initialize) gives: no figures
NO_REPORT = Report(opt_level="", half_dtype=None, enabled=False, casts={}, cache={}, steps=0, skipped_steps=[],
                   loss_scale={}, loss_scale_history={}, time_s={})


def losses_by_step(losses: Sequence[float], every: int, upto: int | None) -> dict[int, float]:
    """{step: loss} of a (thinned: ``losses[i]`` is step ``i * every``) loss curve, before ``upto``."""
    return {i * every: loss for i, loss in enumerate(losses) if upto is None or i * every < upto}


def common_steps(runs: Sequence[LevelRun]) -> int | None:
    """The number of steps whose loss every finished run recorded (None without any): the
    steps before the last recorded loss of the shortest run, that one included."""
    counts = [(len(r.report.losses) - 1) * r.report.losses_every + 1 for r in runs if r.ok and r.report]
    return min(counts) if counts else None


@dataclass(frozen=True)
class RunStats(LevelRun):
    """One level's line of the table (and of ``--json``): its run (the `LevelRun` fields), then
    its statistics."""

    half_dtype: str | None
    steps: int | None
    median_step_ms: float | None
    peak_memory_mib: float | None
    first_loss: float | None               # the loss of the first step: with final_loss, how far it fell
    final_loss: float | None
    losses: list[float]
    losses_every: int                      # a long run's curve is thinned: losses[i] is step i * every
    loss_scale_history: dict[str, list[list[float]]]
    step_times_s: list[float]
    skipped_steps: list[int]
    final_loss_scale: float | None
    speedup_vs_O0: float | None
    max_loss_dev_vs_O0: float | None
    learned_vs_O0: float | None = None     # the share of O0's progress it makes (None: O0's loss does not fall)
    losses_per_step: int = 1               # scale_loss calls per optimizer step (gradient accumulation)
    # bytes per trained parameter for training: weight, master or compensation, optimizer state
    train_bytes_per_param: float | None = None

    @classmethod
    def of(cls, run: LevelRun, baseline: RunStats | None = None, upto: int | None = None) -> RunStats:
        """The row of ``run``; ``baseline`` is O0's row (None: no comparison). ``upto``: final
        loss and deviation from the losses before that step only (a budget let the levels run
        different numbers of steps: they compare at the step all of them reached). Losses
        compare at the same step, also where one curve was thinned more than the other."""
        rep = run.report if run.report is not None else NO_REPORT
        times = list(rep.step_times_s)
        losses = [float(x) if x is not None else math.nan for x in rep.losses]
        every = rep.losses_every
        at = losses_by_step(losses, every, upto)
        steady = times[int(len(times) * WARMUP_FRACTION):] or times
        median_ms = 1000 * statistics.median(steady) if steady else None
        tail = list(at.values())[-FINAL_LOSS_WINDOW:]
        base = baseline if baseline is not None and baseline.ok else None
        ref = base.reference(upto) if base else None
        skipped = list(rep.skipped_steps)
        per_step = losses_per_step(len(losses) * every, run.report.steps if run.report is not None else None)
        dev = deviation(at, ref, skipped, per_step=per_step) if ref else None
        share = learned(at, ref, skipped, per_step=per_step) if ref else None
        return cls(
            level=run.level, ok=run.ok, error=run.error, returncode=run.returncode, wall_s=run.wall_s,
            report=run.report, witness=run.witness,
            half_dtype=None if run.level == BASELINE else rep.half_dtype,
            steps=run.report.steps if run.report is not None else None,
            median_step_ms=median_ms,
            peak_memory_mib=rep.peak_memory_bytes / 2**20 if rep.peak_memory_bytes else None,
            first_loss=next(iter(at.values()), None),
            final_loss=sum(tail) / len(tail) if tail else None,
            losses=losses, losses_every=every,
            loss_scale_history=dict(rep.loss_scale_history),
            step_times_s=times,
            skipped_steps=skipped,
            final_loss_scale=rep.loss_scale.get("loss_scaler0"),
            speedup_vs_O0=base.median_step_ms / median_ms if base and base.median_step_ms and median_ms else None,
            max_loss_dev_vs_O0=dev, learned_vs_O0=share, losses_per_step=per_step,
            train_bytes_per_param=rep.training_bytes_per_param)

    def reference(self, upto: int | None = None) -> Reference:
        """This (O0's) curve, before step `upto`, as the reference other runs are measured against."""
        return Reference.of(losses_by_step(self.losses, self.losses_every, upto))

    def to_dict(self) -> dict[str, Any]:
        """The row as ``--json`` writes it (its report as `Report.to_dict` gives it)."""
        out = dataclasses.asdict(dataclasses.replace(self, report=None))
        out["report"] = self.report.to_dict() if self.report is not None else None
        return out


def summarize(runs: Sequence[LevelRun], upto: int | None = None) -> list[RunStats]:
    """The rows of ``runs``, each compared with O0's run when there is one (see `RunStats.of`)."""
    base_run = next((r for r in runs if r.level == BASELINE), None)
    base = RunStats.of(base_run, None, upto) if base_run is not None else None
    return [RunStats.of(run, base, upto) for run in runs]
