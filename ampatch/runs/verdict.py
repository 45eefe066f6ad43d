"""Whether a run trains like FP32: the rule every candidate of ``tune`` is held to, and the
one ``diagnose`` verifies a fix by.

A candidate *qualifies* when its run finished, every loss is finite, no step was skipped
after the loss scaler's initial back-offs (except *growth probes*: a dynamic scale that grows
after its growth interval of clean steps may overflow once and go back, one skipped step, the
scaler doing its job), it **learns like O0**: its share of O0's progress, measured on the
same batches, lies between `MIN_SHARE` and its inverse at `CONFIDENCE` (the share minus and
plus its one-sided t margin; never waived, whatever the tolerance), its paired differences
from O0 are quiet enough to resolve the tolerance (their noise allowance is within it), and
the deviation of its loss curve from O0's goes no further than the tolerance beyond that
allowance (`ampatch.runs.deviation.against`: relative to O0's progress over the run). A
reference whose progress is not beyond its own noise is no reference: the search stops
before any candidate is judged (`search.NoProgress`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ampatch.runs.stats import RunStats, losses_by_step
from ampatch.runs.deviation import CONFIDENCE, MIN_SHARE, Basis, Reference, against, initial_backoffs

__all__ = ["Rule", "Verdict", "judge", "growth_probes"]


@dataclass(frozen=True)
class Rule:
    """The tolerance (relative to O0's progress), and the confidence of the tests."""

    tolerance: float
    confidence: float = CONFIDENCE

    def describe(self) -> str:
        return f"{self.tolerance:.2%}"


@dataclass(frozen=True)
class Verdict:
    qualifies: bool
    reason: str
    finite: bool
    deviation: float | None
    learned: float | None = None
    learned_margin: float | None = None   # the share is at least learned - learned_margin at the rule's confidence
    noise: float | None = None            # the deviation's noise allowance (relative to O0's progress)
    beyond: float | None = None           # how far the deviation goes beyond that allowance
    judged: bool = True                   # False: the runs cannot tell (O0 did not learn, too noisy, too short)


def growth_probes(skipped: Sequence[int], history: Sequence[Sequence[float]]) -> set[int]:
    """The skipped steps that are a dynamic loss scaler probing a grown scale: a lone skip (the
    steps before and after it ran) that takes the scale from the value its latest growth set back to at
    least where it was before that growth. `history`: the scaler's (step, scale) change points."""
    points = [(int(i), float(s)) for i, s in history]
    done = set(skipped)
    probes = set()
    for s in skipped:
        if s - 1 in done or s + 1 in done:
            continue
        at = max((j for j, (i, _) in enumerate(points) if i == s), default=None)
        if at is None or at < 2:
            continue
        before, grown, after = points[at - 2][1], points[at - 1][1], points[at][1]
        if grown > before and before <= after < grown:
            probes.add(s)
    return probes


def _late_skips(row: RunStats) -> list[int]:
    """Steps skipped after the initial back-offs that are not growth probes."""
    backoffs = initial_backoffs(row.skipped_steps)
    history = row.loss_scale_history.get("loss_scaler0", [])
    probes = growth_probes(row.skipped_steps, history)
    return [s for s in row.skipped_steps if s >= backoffs and s not in probes]


def _pm(margin: float | None) -> str:
    return f" ± {margin:.0%}" if margin and f"{margin:.0%}" != "0%" else ""


def judge(row: RunStats, rule: Rule, reference: Reference, upto: int | None = None) -> Verdict:
    """The verdict of a run's row against O0's curve (`reference`: `RunStats.reference(upto)` of O0's
    row), on the losses before step `upto` (None: all)."""
    if not row.ok:
        return Verdict(False, f"run failed: {row.error}", False, None)
    losses = row.losses
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    c = against(losses_by_step(losses, row.losses_every, upto), reference, row.skipped_steps,
                per_step=row.losses_per_step, confidence=rule.confidence)
    dev, share = c.deviation, c.learned
    margin = c.learned_margin(rule.confidence)
    figures = dict(deviation=dev, learned=share, learned_margin=margin, noise=c.noise, beyond=c.beyond)
    if not finite:
        first = next(i for i, x in enumerate(losses) if not math.isfinite(x)) * row.losses_every if losses else 0
        return Verdict(False, f"loss not finite from step {first // row.losses_per_step}", False, **figures)
    late = _late_skips(row)
    if late:
        return Verdict(False, f"{len(late)} step(s) skipped after the loss scaler's first back-offs (first: {late[0]})",
                       True, **figures)
    if reference.basis is not Basis.PROGRESS:
        return Verdict(False, f"O0 made no detectable progress to judge against ({reference.why_not()})", True,
                       **figures, judged=False)
    if dev is None:
        return Verdict(False, "no loss to compare with O0's", True, **figures)
    if share is None:
        return Verdict(False, f"too few losses on the steps O0 has to tell whether it learns; deviation {dev:.2%}",
                       True, **figures, judged=False)
    m = margin or 0.0
    if share - m < MIN_SHARE or share + m > 1 / MIN_SHARE:
        return Verdict(False, f"learns {share:.0%}{_pm(margin)} of what O0 learns (between {MIN_SHARE:.0%} and "
                              f"{1 / MIN_SHARE:.0%} needed, whatever the tolerance, at {rule.confidence:.0%} "
                              f"confidence); deviation {dev:.2%}", True, **figures)
    noise, beyond = c.noise or 0.0, c.beyond if c.beyond is not None else dev
    if noise > rule.tolerance:
        return Verdict(False, f"too noisy to judge at this tolerance: its per-step differences from O0 stray "
                              f"{noise:.2%} of O0's progress by noise alone ({rule.confidence:.0%} confidence), more "
                              f"than the {rule.tolerance:.2%} tolerance (run more steps); deviation {dev:.2%}",
                       True, **figures, judged=False)
    shown = f"{noise:.2%}" != "0.00%"   # a noise that rounds to 0 is not worth a word
    said = f"deviation {dev:.2%}" + (f" ({beyond:.2%} beyond its noise of {noise:.2%})" if shown else "")
    if beyond > rule.tolerance:
        return Verdict(False, f"{said} > tolerance {rule.describe()}", True, **figures)
    return Verdict(True, f"{said} within {rule.describe()}", True, **figures)
