"""Whether a run trains like FP32: the one verdict `compare`, `tune` and `diagnose` give a
level, with three outcomes (`Outcome`): it *qualifies*, it *fails* (with the reason), or the
runs *cannot tell* (with what would decide it: more steps, or a wider tolerance: `Decider`).

A run fails when it did not finish, a loss is not finite, or a step was skipped after the loss
scaler's first back-offs (`first_backoffs`: the first run of skipped steps, wherever it starts,
the scale finding what fits; and except *growth probes*: a dynamic scale that grows after its
growth interval of clean steps may overflow once and go back, one skipped step, the scaler
doing its job). Then two witnesses, the loss first:

- **The loss** (`ampatch.runs.deviation`), where O0 made progress beyond its noise and its
  rounding, and the run's own loss resolves that progress: its share of O0's progress (same
  batches) must lie between `MIN_SHARE` and its inverse at `CONFIDENCE` (the share minus and
  plus its one-sided t margin; never waived, whatever the tolerance): wholly outside, it fails;
  straddling a bound, the loss cannot tell yet. Its paired differences from O0 must be quiet
  enough to resolve the tolerance (their noise allowance within it; else the loss cannot tell,
  and names the tolerance it could decide at), and the deviation of its curve from O0's may
  go no further than the tolerance beyond that allowance (else it fails, however noisy: the
  allowance already grants the noise its due).
- **The weights** (`ampatch.runs.weights`), where the loss cannot tell: how far the run's
  weights went O0's way (the same band as the loss's share, at the same confidence: a stalled
  run fails even where the loss is flat) and, to qualify on them, how close they stay to O0's
  (the upper bound of their distance within the tolerance). They also arbitrate a run that
  learns like O0 but whose loss curve strays beyond the tolerance: where its weights stay
  within the tolerance of O0's, the curve's distance is the loss's own arithmetic in half
  precision (a bfloat16 forward computes the same weights' loss 1e-4 off, 2.4% of a progress
  of 0.005), not its training, and it qualifies on them. A verdict reached on the weights says
  so (`Verdict.evidence`).

Neither witness decides: the runs cannot tell, and `Verdict.decide` says what would.
"""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

from ampatch.runs.deviation import CONFIDENCE, MIN_SHARE, Basis, Comparison, Reference, against, initial_backoffs
from ampatch.runs.stats import RunStats, losses_by_step
from ampatch.runs.weights import WeightComparison, compare
from ampatch.session.witness import Witness

__all__ = ["Rule", "Outcome", "Evidence", "Decider", "Verdict", "judge", "label", "growth_probes", "first_backoffs"]


@dataclass(frozen=True)
class Rule:
    """The tolerance (relative to O0's progress), and the confidence of the tests."""

    tolerance: float
    confidence: float = CONFIDENCE

    def describe(self) -> str:
        return f"{self.tolerance:.2%}"


class Outcome(enum.Enum):
    """What a verdict says of a run."""

    QUALIFIES = "qualifies"
    FAILS = "fails"
    CANNOT_TELL = "cannot tell"


class Evidence(enum.Enum):
    """What a verdict rests on."""

    LOSS = "loss"
    WEIGHTS = "weights"
    RUN = "run"          # the run itself: it failed, a loss is not finite, a late skipped step


@dataclass(frozen=True)
class Decider:
    """What would let the runs decide: about this many steps, or a tolerance at least this wide."""

    steps: int | None = None
    tolerance: float | None = None

    def describe(self) -> str:
        parts = [] if self.steps is None else [f"about {self.steps} steps"]
        parts += [] if self.tolerance is None else [f"a tolerance of {self.tolerance:.2%} or more"]
        return " or ".join(parts) or "a run that learns more"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str
    finite: bool
    deviation: float | None
    learned: float | None = None
    learned_margin: float | None = None   # the share is at least learned - learned_margin at the rule's confidence
    noise: float | None = None            # the deviation's noise allowance (relative to O0's progress)
    beyond: float | None = None           # how far the deviation goes beyond that allowance
    evidence: Evidence = Evidence.LOSS   # what the outcome rests on
    decide: Decider | None = None         # for CANNOT_TELL: what would decide it
    steps: int | None = None              # the steps the verdict rests on
    weights: WeightComparison | None = None

    @property
    def qualifies(self) -> bool:
        return self.outcome is Outcome.QUALIFIES

    @property
    def judged(self) -> bool:
        """False: the runs cannot tell."""
        return self.outcome is not Outcome.CANNOT_TELL

    @property
    def label(self) -> str:
        return label(self.outcome, self.evidence)


def label(outcome: Outcome, evidence: Evidence) -> str:
    """A verdict in a word or two, as the tables show it: "ok", "FAIL", "ok (weights)", "can't tell"."""
    word = {Outcome.QUALIFIES: "ok", Outcome.FAILS: "FAIL", Outcome.CANNOT_TELL: "can't tell"}[outcome]
    return f"{word} (weights)" if evidence is Evidence.WEIGHTS and outcome is not Outcome.CANNOT_TELL else word


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


def first_backoffs(skipped: Sequence[int]) -> list[int]:
    """The loss scaler's first back-offs: the first run of consecutive skipped steps, wherever
    it starts (a dynamic scale finding what fits: at step 0 when its start overflows at once, or
    at the first step whose gradients outgrow it)."""
    steps = sorted(set(skipped))
    out = steps[:1]
    for s in steps[1:]:
        if s != out[-1] + 1:
            break
        out.append(s)
    return out


def _late_skips(row: RunStats) -> list[int]:
    """Steps skipped after the first back-offs that are not growth probes."""
    first = set(first_backoffs(row.skipped_steps)) | set(range(initial_backoffs(row.skipped_steps)))
    history = row.loss_scale_history.get("loss_scaler0", [])
    probes = growth_probes(row.skipped_steps, history)
    return [s for s in row.skipped_steps if s not in first and s not in probes]


def _pm(margin: float | None) -> str:
    return f" ± {margin:.0%}" if margin and f"{margin:.0%}" != "0%" else ""


def _more_steps(steps: int | None, factor: float) -> int | None:
    """About how many steps would decide, from `steps` and how far short the run fell (at least twice as many)."""
    if not steps:
        return None
    return int(math.ceil(steps * max(2.0, min(factor, 1e6))))


class _Figures(TypedDict):
    """The figures every verdict of a run that ran carries (`Verdict`'s fields of the same names)."""

    deviation: float | None
    learned: float | None
    learned_margin: float | None
    noise: float | None
    beyond: float | None
    steps: int | None


@dataclass(frozen=True)
class _Loss:
    """The loss's own verdict: an outcome, or None with why it cannot tell and what would decide."""

    outcome: Outcome | None
    reason: str
    decide: Decider | None = None
    strays: bool = False   # it fails on its curve's distance from O0's alone (it learns like O0)


def _by_loss(c: Comparison, rule: Rule, reference: Reference, steps: int | None) -> _Loss:
    dev, share, margin = c.deviation, c.learned, c.learned_margin(rule.confidence)
    if reference.basis is not Basis.PROGRESS:
        z, need = reference.significance, reference.needed
        grow = (need / z) ** (2 / 3) if z and need and z > 0 and math.isfinite(z) else 2.0
        if not reference.resolved and reference.progress and reference.floor and reference.progress > 0:
            grow = reference.floor / reference.progress
        return _Loss(None, f"O0 made no detectable progress to judge against ({reference.why_not()})",
                     Decider(_more_steps(steps, grow)))
    if dev is None:
        return _Loss(Outcome.FAILS, "no loss to compare with O0's")
    if c.unresolved is not None:
        return _Loss(None, c.unresolved, Decider(_more_steps(steps, 2.0)))
    if share is None:
        return _Loss(None, f"too few losses on the steps O0 has to tell whether it learns; deviation {dev:.2%}",
                     Decider(_more_steps(steps, 2.0)))
    m = margin or 0.0
    band = (f"between {MIN_SHARE:.0%} and {1 / MIN_SHARE:.0%} needed, whatever the tolerance, at "
            f"{rule.confidence:.0%} confidence")
    learns = f"learns {share:.0%}{_pm(margin)} of what O0 learns"
    if share + m < MIN_SHARE or share - m > 1 / MIN_SHARE:
        return _Loss(Outcome.FAILS, f"{learns} ({band}); deviation {dev:.2%}")
    if share - m < MIN_SHARE or share + m > 1 / MIN_SHARE:
        return _Loss(None, f"{learns}: too uncertain to say whether it is {band.replace(' needed', '')}; "
                           f"deviation {dev:.2%}", Decider(_more_steps(steps, 2.0)))
    noise, beyond = c.noise or 0.0, c.beyond if c.beyond is not None else dev
    if noise > rule.tolerance and beyond <= rule.tolerance:  # beyond its noise by more than the tolerance: it fails
        return _Loss(None, f"too noisy to judge at this tolerance ({rule.tolerance:.2%}): its per-step differences "
                           f"from O0 stray {noise:.2%} of O0's progress by noise alone ({rule.confidence:.0%} "
                           f"confidence); it could decide at a tolerance of {noise:.2%}; deviation {dev:.2%}",
                     Decider(_more_steps(steps, noise / rule.tolerance), noise))
    shown = f"{noise:.2%}" != "0.00%"   # a noise that rounds to 0 is not worth a word
    said = f"deviation {dev:.2%}" + (f" ({beyond:.2%} beyond its noise of {noise:.2%})" if shown else "")
    if beyond > rule.tolerance:
        return _Loss(Outcome.FAILS, f"{said} > tolerance {rule.describe()}", strays=True)
    return _Loss(Outcome.QUALIFIES, f"{said} within {rule.describe()}")


def _by_weights(w: WeightComparison | None, rule: Rule) -> tuple[Outcome | None, str]:
    """The weights' verdict (None: they cannot tell either) and why."""
    if w is None:
        return None, "no weights witness was recorded"
    if not w.witnesses:
        return None, str(w.why_not)
    share, m = w.share or 0.0, w.margin or 0.0
    moves = (f"its weights move {share:.0%}{_pm(m)} of O0's way over {w.updates} updates "
             f"({(w.run_moved or 0.0):.0%} of them changed, O0's {(w.moved or 0.0):.0%})")
    if share + m < MIN_SHARE or share - m > 1 / MIN_SHARE:
        return Outcome.FAILS, f"{moves}, outside {MIN_SHARE:.0%} to {1 / MIN_SHARE:.0%} at {rule.confidence:.0%}"
    near = f"their distance from O0's is {w.deviation:.2%} of O0's movement (at most {w.bound:.2%})"
    if share - m >= MIN_SHARE and share + m <= 1 / MIN_SHARE and (w.bound or 0.0) <= rule.tolerance:
        return Outcome.QUALIFIES, f"on its weights: {moves}; {near}, within {rule.describe()}"
    return None, f"{moves}; {near}: not close enough to O0's to qualify on them"


def judge(row: RunStats, rule: Rule, reference: Reference, upto: int | None = None,
          o0_witness: Witness | None = None) -> Verdict:
    """The verdict of a run's row against O0's curve (`reference`: `RunStats.reference(upto)` of
    O0's row) and weights (`o0_witness`: O0's row's), on the losses before step `upto` (None: all)."""
    steps = row.steps if upto is None or row.steps is None else min(row.steps, upto)
    if not row.ok:
        return Verdict(Outcome.FAILS, f"run failed: {row.error}", False, None, evidence=Evidence.RUN, steps=steps)
    losses = row.losses
    finite = bool(losses) and all(math.isfinite(x) for x in losses)
    c = against(losses_by_step(losses, row.losses_every, upto), reference, row.skipped_steps,
                per_step=row.losses_per_step, confidence=rule.confidence)
    figures = _Figures(deviation=c.deviation, learned=c.learned, learned_margin=c.learned_margin(rule.confidence),
                       noise=c.noise, beyond=c.beyond, steps=steps)
    if not finite:
        first = next(i for i, x in enumerate(losses) if not math.isfinite(x)) * row.losses_every if losses else 0
        return Verdict(Outcome.FAILS, f"loss not finite from step {first // row.losses_per_step}", False,
                       evidence=Evidence.RUN, **figures)
    late = _late_skips(row)
    if late:
        return Verdict(Outcome.FAILS, f"{len(late)} step(s) skipped after the loss scaler's first back-offs (first: "
                                      f"{late[0]})", True, evidence=Evidence.RUN, **figures)
    loss = _by_loss(c, rule, reference, steps)
    weights = compare(row.witness, o0_witness, rule.confidence)
    outcome, why = _by_weights(weights, rule)
    if loss.strays and outcome is Outcome.QUALIFIES:  # the curve strays, the training does not: the loss's arithmetic
        return Verdict(outcome, f"{why}; its loss curve strays from O0's ({loss.reason}) where its weights do not: "
                                "the loss's own arithmetic in half precision, not its training",
                       True, evidence=Evidence.WEIGHTS, weights=weights, **figures)
    if loss.outcome is not None:
        return Verdict(loss.outcome, loss.reason, True, weights=weights, **figures)
    if outcome is not None:
        return Verdict(outcome, f"{why} (the loss cannot tell: {loss.reason})", True, evidence=Evidence.WEIGHTS,
                       weights=weights, **figures)
    decide = loss.decide or Decider()
    return Verdict(Outcome.CANNOT_TELL, f"{loss.reason}; the weights cannot tell either: {why}; to decide: "
                                        f"{decide.describe()}", True, decide=decide,
                   weights=weights, **figures)
