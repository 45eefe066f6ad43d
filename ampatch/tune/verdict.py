"""Whether a candidate's run trains like FP32: the rule every run of ``tune`` is held to.

A candidate *qualifies* when its run finished, every loss is finite, no step was skipped
after the loss scaler's initial back-offs (except *growth probes*: a dynamic scale that grows
after its growth interval of clean steps may overflow once and go back, one skipped step, the
scaler doing its job), it learns at least `MIN_SHARE` of what O0 learns (when O0's loss falls:
never waived, whatever the tolerance), and the deviation of its loss curve from O0's
(`ampatch.runs.deviation`: relative to O0's progress over the run) is within the tolerance
above the *noise floor*: how far O0's curve is from itself, measured by running O0 again
(`Rule.floor`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ampatch.compare.rows import Row
from ampatch.runs.deviation import MIN_SHARE, initial_backoffs

__all__ = ["Rule", "Verdict", "judge", "growth_probes"]


@dataclass(frozen=True)
class Rule:
    """The tolerance, and the noise floor it sits on (O0 against its own repeats)."""

    tolerance: float
    floor: float = 0.0

    @property
    def limit(self) -> float:
        return self.tolerance + self.floor

    def describe(self) -> str:
        return f"{self.tolerance:.2%}" + (f" + {self.floor:.2%} noise floor" if self.floor > 0 else "")


@dataclass(frozen=True)
class Verdict:
    qualifies: bool
    reason: str
    finite: bool
    deviation: float | None
    learned: float | None = None


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


def _late_skips(row: Row) -> list[int]:
    """Steps skipped after the initial back-offs that are not growth probes."""
    backoffs = initial_backoffs(row.skipped_steps)
    history = row.loss_scale_history.get("loss_scaler0", [])
    probes = growth_probes(row.skipped_steps, history)
    return [s for s in row.skipped_steps if s >= backoffs and s not in probes]


def judge(row: Row, rule: Rule) -> Verdict:
    """The verdict of a run's row against O0's (already in `row`: its deviation and the share
    of O0's progress it makes)."""
    if not row.ok:
        return Verdict(False, f"run failed: {row.error}", False, None)
    losses = row.losses
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    dev, share = row.max_loss_dev_vs_O0, row.learned_vs_O0
    if not finite:
        first = next(i for i, x in enumerate(losses) if not math.isfinite(x)) * row.losses_every if losses else 0
        return Verdict(False, f"loss not finite from step {first // row.losses_per_step}", False, dev, share)
    late = _late_skips(row)
    if late:
        return Verdict(False, f"{len(late)} step(s) skipped after the loss scaler's first back-offs (first: {late[0]})",
                       True, dev, share)
    if dev is None:
        return Verdict(False, "no loss to compare with O0's", True, dev, share)
    if share is not None and share < MIN_SHARE:
        return Verdict(False, f"learns {share:.0%} of what O0 learns (at least {MIN_SHARE:.0%} needed, whatever the "
                              f"tolerance); deviation {dev:.2%}", True, dev, share)
    if dev > rule.limit:
        return Verdict(False, f"deviation {dev:.2%} > tolerance {rule.describe()}", True, dev, share)
    return Verdict(True, f"deviation {dev:.2%} within {rule.describe()}", True, dev, share)
