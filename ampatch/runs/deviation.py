"""The one measure of how far a run's loss curve strays from O0's, and of how much it learns.

``compare`` shows it ("max dev vs O0"), ``diagnose`` verifies a fix with it, and ``tune``
holds every candidate to it (``--tolerance``). Curves are losses by 0-based index of the
``scale_loss`` call (loss id 0), as the session's report records them: one per optimizer
step, or ``per_step`` of them under gradient accumulation.

**Relative to what O0 learns.** A short run barely moves the loss against its level (a
fine-tuning run at loss 9 falls 0.1 in 40 steps), so a deviation relative to the level calls
a run that learns nothing "within 1.4%". The deviation is relative to O0's *progress* ``P``,
how far O0's loss falls over the run (the mean of its first `WINDOW` losses minus the mean of
its last `WINDOW`)::

    deviation = max over steps s of |mean(L, window ending at s) - mean(R, window ending at s - k)| / P

**Curves that do not fall.** When O0's loss falls by less than `MIN_FALL` of its level, or by
no more than `NOISE_MARGIN` standard errors of that fall (the per-step noise measured from
O0's own curve: the spread of its step-to-step changes), there is no progress to measure
against: the deviation is then relative to O0's level at each step, ``|...| / |mean(R, ...)|``
(`Basis.LEVEL`, the measure before).

**Learning.** `learned` is the share of O0's progress a run makes over the same steps (1.0:
as much as O0; 0: none). ``tune`` never accepts a run that learns less than `MIN_SHARE` of
what O0 learns, whatever the tolerance.

**The shift.** ``k`` is the number of the loss scaler's *initial back-offs* (steps skipped in
a row from step 0 while a dynamic loss scale falls from its start to a scale that fits),
times the losses per optimizer step. A skipped step leaves the weights as they were, so at
step ``s`` the run has made ``s - k`` updates, as O0 had at step ``s - k``: the curves are
compared update for update (without the shift, one skipped first step made a float16 T5 run
whose final loss was within 0.5% of O0's show 0.95). The back-off steps themselves are not
compared; a step skipped later is not shifted.

A non-finite loss makes the deviation infinite. Only the steps both curves have are compared
(a long run's curve is thinned, a budget cuts one short); None when none is.
"""
from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["WINDOW", "TOLERANCE", "MIN_FALL", "NOISE_MARGIN", "MIN_SHARE", "DIVERGE", "Basis", "Reference",
           "initial_backoffs", "losses_per_step", "deviation", "learned", "unsound"]

WINDOW = 5          # losses averaged at each step before comparing (the compare table's final-loss window)
TOLERANCE = 0.02    # tune's default --tolerance; diagnose holds a verified fix to it
MIN_FALL = 0.005    # O0 learns when its loss falls by at least this share of its level over the run ...
NOISE_MARGIN = 2.0  # ... and by more than this many standard errors of that fall
MIN_SHARE = 0.5     # a run that learns less than this share of what O0 learns never qualifies in tune
DIVERGE = 1.0       # a positive O0 loss ending this share above where it started (doubled): the reference diverges
TINY = 1e-12        # a reference loss this close to 0 is compared against this instead


class Basis(enum.Enum):
    """What a deviation is relative to."""

    PROGRESS = "progress"   # O0's loss falls: how far it falls over the run
    LEVEL = "level"         # it does not: O0's loss at each step


def _ends(values: Sequence[float], window: int) -> tuple[float, float] | None:
    """(mean of the first, mean of the last) `window` values (fewer when the curve is short:
    at most half of it each); None for fewer than 2 values."""
    if len(values) < 2:
        return None
    w = max(1, min(window, len(values) // 2))
    return sum(values[:w]) / w, sum(values[-w:]) / w


@dataclass(frozen=True)
class Reference:
    """O0's curve read once: what it learns over the run, and so what a deviation is relative to."""

    curve: Mapping[int, float]
    basis: Basis
    first: float | None = None      # mean of its first window
    last: float | None = None       # ... of its last
    noise: float | None = None      # standard error of first - last, from its step-to-step changes
    window: int = WINDOW

    @property
    def progress(self) -> float | None:
        """How far O0's loss falls over the run (first window's mean minus last window's)."""
        return None if self.first is None or self.last is None else self.first - self.last

    @classmethod
    def of(cls, curve: Mapping[int, float], window: int = WINDOW) -> Reference:
        """O0's curve {step: loss}: its progress, and the basis that follows (module docstring)."""
        values = [curve[s] for s in sorted(curve)]
        ends = _ends(values, window) if all(math.isfinite(v) for v in values) else None
        if ends is None:
            return cls(dict(curve), Basis.LEVEL, window=window)
        first, last = ends
        changes = [b - a for a, b in zip(values, values[1:])]
        w = max(1, min(window, len(values) // 2))
        noise = (statistics.pstdev(changes) / math.sqrt(2)) * math.sqrt(2 / w) if len(changes) > 1 else 0.0
        falls = first - last >= MIN_FALL * abs(first) and first - last > NOISE_MARGIN * noise
        return cls(dict(curve), Basis.PROGRESS if falls else Basis.LEVEL, first, last, noise, window)

    def scale(self, value: float) -> float:
        """The denominator at a step where O0's smoothed loss is `value`."""
        if self.basis is Basis.PROGRESS:
            return self.progress  # type: ignore[return-value]
        return max(abs(value), TINY)

    def describe(self) -> str:
        """One line for footnotes: what the deviation is relative to, with the figures."""
        if self.basis is Basis.PROGRESS:
            return (f"relative to O0's progress (its loss falls {self.progress:.4g} over the run, from "
                    f"{self.first:.4g} to {self.last:.4g}, {self.window}-loss means)")
        if self.progress is None:
            why = "too few finite losses to read a fall from"
        elif self.progress < MIN_FALL * abs(self.first):  # type: ignore[arg-type]
            why = f"it falls by less than {MIN_FALL:.1%} of its level"
        else:
            why = (f"its fall, {self.progress:.3g}, is within {NOISE_MARGIN:g} standard errors ({self.noise:.3g}) of "
                   "its noise")
        return f"relative to O0's loss level at each step ({why})"

    def to_dict(self) -> dict[str, object]:
        return {"basis": self.basis.value, "first": self.first, "last": self.last, "progress": self.progress,
                "noise": self.noise, "window": self.window}


def initial_backoffs(skipped: Sequence[int]) -> int:
    """How many steps were skipped in a row from step 0 (0-based step numbers): the dynamic
    loss scaler's initial back-offs."""
    done = set(skipped)
    k = 0
    while k in done:
        k += 1
    return k


def losses_per_step(losses: int, steps: int | None) -> int:
    """The losses recorded per optimizer step (gradient accumulation: one per micro-batch),
    from `losses` scale_loss calls over `steps` optimizer steps."""
    if not steps or steps <= 0 or losses <= 0:
        return 1
    return max(1, round(losses / steps))


def _smoothed(curve: Mapping[int, float], window: int) -> dict[int, float]:
    """{step: mean of the last `window` losses up to and including that step}, in step order."""
    steps = sorted(curve)
    out: dict[int, float] = {}
    for i, step in enumerate(steps):
        part = [curve[s] for s in steps[max(0, i - window + 1):i + 1]]
        out[step] = sum(part) / len(part)
    return out


def _paired(losses: Mapping[int, float], reference: Mapping[int, float], skipped: Sequence[int],
            per_step: int) -> tuple[list[int], int] | None:
    """(our steps that compare, the shift k in loss entries); None when one of our compared
    losses is not finite."""
    k = initial_backoffs(skipped) * max(1, per_step)
    mine = [s for s in sorted(losses) if s >= k]
    if any(not math.isfinite(losses[s]) for s in mine):
        return None
    common = [s for s in mine if s - k in reference]   # a thinned curve has only some steps
    if not common and k:  # a long run's thinned curves (every n-th loss) share no step k apart:
        stride = min((b - a for a, b in zip(sorted(reference), sorted(reference)[1:])), default=1)
        k -= k % stride   # shift by whole strides (an update or so off, over thousands of steps)
        common = [s for s in mine if s - k in reference]
    return common, k


def _reference(reference: Mapping[int, float] | Reference, window: int) -> Reference:
    return reference if isinstance(reference, Reference) else Reference.of(reference, window)


def deviation(losses: Mapping[int, float], reference: Mapping[int, float] | Reference, skipped: Sequence[int] = (),
              window: int = WINDOW, per_step: int = 1) -> float | None:
    """The deviation of the curve `losses` ({step: loss}) from O0's `reference` (its curve or
    its `Reference`); `skipped`: the run's skipped optimizer steps, whose leading streak is
    shifted out, `per_step` losses each (see the module docstring). None when no step compares."""
    ref = _reference(reference, window)
    paired = _paired(losses, ref.curve, skipped, per_step)
    if paired is None:
        return math.inf
    common, k = paired
    ours = _smoothed({s: losses[s] for s in common}, window)
    theirs = _smoothed({s - k: ref.curve[s - k] for s in common}, window)
    worst = None
    for step, value in ours.items():
        r = theirs[step - k]
        if not math.isfinite(r):
            return math.inf
        dev = abs(value - r) / ref.scale(r)
        worst = dev if worst is None else max(worst, dev)
    return worst


def learned(losses: Mapping[int, float], reference: Mapping[int, float] | Reference, skipped: Sequence[int] = (),
            window: int = WINDOW, per_step: int = 1) -> float | None:
    """The share of O0's progress the curve `losses` makes over the same updates (1.0: as much
    as O0, 0: none, negative: its loss rose). None when O0 does not learn (`Basis.LEVEL`),
    a loss is not finite or the curves share too few steps."""
    ref = _reference(reference, window)
    if ref.basis is not Basis.PROGRESS:
        return None
    paired = _paired(losses, ref.curve, skipped, per_step)
    if paired is None:
        return None
    common, k = paired
    ours = _ends([losses[s] for s in common], window)
    theirs = _ends([ref.curve[s - k] for s in common], window)
    if ours is None or theirs is None or theirs[0] - theirs[1] <= 0:
        return None
    return (ours[0] - ours[1]) / (theirs[0] - theirs[1])


def unsound(reference: Mapping[int, float], per_step: int = 1, window: int = WINDOW) -> str | None:
    """Why O0's curve cannot be the reference (None when it can): a loss that is not finite,
    or a positive one that ends more than `DIVERGE` above where it started (more than doubles:
    a loss that rises a little, as a GAN's may, is not diverging; a signed loss is not judged)."""
    steps = sorted(reference)
    bad = next((s for s in steps if not math.isfinite(reference[s])), None)
    if bad is not None:
        return f"its loss is not finite from step {bad // max(1, per_step)} ({reference[bad]})"
    ends = _ends([reference[s] for s in steps], window)
    if ends is not None and ends[0] > 0 and ends[1] > (1 + DIVERGE) * ends[0]:
        return (f"its loss rises from {ends[0]:.4g} to {ends[1]:.4g} over the run ({window}-loss means): it "
                "diverges")
    return None
