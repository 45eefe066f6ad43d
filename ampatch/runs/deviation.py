"""The one measure of how far a run's loss curve strays from O0's, how much it learns, and
whether O0 learned anything at all: each judged from the runs' own statistics.

``compare`` shows it ("max dev vs O0"), ``diagnose`` verifies a fix with it, and ``tune``
holds every candidate to it (``--tolerance``). Curves are losses by 0-based index of the
``scale_loss`` call (loss id 0), as the session's report records them: one per optimizer
step, or ``per_step`` of them under gradient accumulation.

**Relative to what O0 learns.** A short run barely moves the loss against its level (a
fine-tuning run at loss 9 falls 0.1 in 40 steps), so a deviation relative to the level calls
a run that learns nothing "within 1.4%". The deviation is relative to O0's *progress* ``P``:
the mean of its first losses minus the mean of its last (`ends`: an eighth of the run at each
end, at least `WINDOW` losses)::

    deviation = max over steps s of |mean(L, window ending at s) - mean(R, window ending at s - k)| / P

**Noise, from the run itself.** A loss is its batch's: it scatters around the curve's trend.
That scatter σ is read from the curve's second differences (`noise.noise_of`). O0 *makes
progress* when its least-squares trend falls by more than the one-sided Student-t quantile at
`CONFIDENCE` times that fall's standard error (`noise.trend`: every loss counts, so for a
steady fall the test grows with the run, as a comparison of a few losses at each end does
not), P is positive, and P is a fall the loss's own arithmetic resolves
(`resolution.resolves`: beyond a few ulps of the dtype its values are computed in). When it
does not, nothing can be learned a share of: the deviation is then relative to O0's level at
each step (`Basis.LEVEL`, what ``compare`` shows), and ``tune`` runs longer or asks the
weights (`ampatch.runs.weights`).

**A candidate against O0** (`against`) is judged on the same batches: every run of a
command draws the same data, so the paired differences ``D = L - R`` carry almost none of the
batch-to-batch noise that both losses share. From them:

- `learned`: the share of O0's progress the run makes over the same updates (1.0: as much as
  O0; 0: none), with its standard error (delta method over the second-difference variances
  and covariance of R and D). ``tune`` requires it to be at least `MIN_SHARE` at `CONFIDENCE`
  (learning closer to all of O0's progress than to none), whatever the tolerance.
- the *noise* of the deviation: how far a window mean of D strays by D's own noise alone, at
  `CONFIDENCE` over every compared step (Bonferroni), relative to P; `beyond`: how far the
  deviation goes past that allowance (at each step, for the losses in its window). ``tune``
  holds `beyond` to the tolerance, and cannot qualify a run whose noise alone exceeds it (one
  that goes beyond that noise by more than the tolerance fails all the same).
- `unresolved`: why the run's own loss cannot witness P (its values are computed in a dtype
  whose rounding at that level is as large as P: a bfloat16 loss cannot show a fall of 3e-7).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from ampatch.runs import noise, resolution
from ampatch.runs.noise import Noise, noise_of, second_differences, t_quantile, trend

__all__ = ["WINDOW", "ENDS", "TOLERANCE", "CONFIDENCE", "MIN_SHARE", "DIVERGE", "Basis", "Noise", "Reference",
           "Comparison", "initial_backoffs", "losses_per_step", "deviation", "gap_curve", "learned", "against",
           "unsound",
           "ends_window", "noise_of", "t_quantile"]

WINDOW = 5          # losses averaged at each step before comparing (the compare table's final-loss window)
ENDS = 8            # P: the mean of the first and of the last 1/ENDS of the curve (at least WINDOW losses each)
TOLERANCE = 0.02    # tune's default --tolerance; diagnose holds a verified fix to it
CONFIDENCE = 0.99   # one-sided confidence of every test here: O0's progress, a run's share of it, the noise allowance
MIN_SHARE = 0.5     # tune: a run must learn between this share of O0's progress and its inverse (at CONFIDENCE)
DIVERGE = 1.0       # a positive O0 loss ending this share above where it started (doubled): the reference diverges
TINY = 1e-12        # a reference loss this close to 0 is compared against this instead


class Basis(enum.Enum):
    """What a deviation is relative to."""

    PROGRESS = "progress"   # O0's loss falls beyond its noise: how far it falls over the run
    LEVEL = "level"         # it does not: O0's loss at each step


# ------------------------------------------------------------------ statistics (`noise`)
def ends_window(n: int, window: int = WINDOW) -> int:
    """How many losses at each end make the first and last means of a curve of `n` losses: an
    `ENDS`-th of it, at least `window`, at most half of it."""
    return max(1, min(max(window, n // ENDS), n // 2))


def _ends(values: Sequence[float], window: int) -> tuple[float, float] | None:
    """(mean of the first, mean of the last) `ends_window` values; None for fewer than 2 values."""
    if len(values) < 2:
        return None
    w = ends_window(len(values), window)
    return sum(values[:w]) / w, sum(values[-w:]) / w


# ------------------------------------------------------------------ O0's curve
@dataclass(frozen=True)
class Reference:
    """O0's curve read once: what it learns over the run, whether that is beyond its own noise
    and its own rounding, and so what a deviation is relative to."""

    curve: Mapping[int, float]
    basis: Basis
    first: float | None = None      # mean of its first `ends` losses
    last: float | None = None       # ... of its last
    noise: float | None = None      # σ: the per-loss scatter around its trend (second differences)
    window: int = WINDOW            # the deviation's smoothing window
    ends: int | None = None         # losses in each of the first and last means
    se: float | None = None         # standard error of the trend's fall (`noise.trend`)
    needed: float | None = None     # the t quantile the trend's fall must reach, in standard errors
    confidence: float = CONFIDENCE
    trend: float | None = None      # how far its least-squares line falls over the run
    dtype: str = "float32"          # the dtype its values are computed in (`resolution.dtype_of`)
    floor: float | None = None      # the smallest fall that dtype resolves at its level

    @property
    def progress(self) -> float | None:
        """How far O0's loss falls over the run (first means minus last)."""
        return None if self.first is None or self.last is None else self.first - self.last

    @property
    def significance(self) -> float | None:
        """The trend's fall in standard errors of the curve's own noise (inf: a noiseless fall)."""
        if self.trend is None or self.se is None:
            return None
        if self.se == 0:
            return math.inf if self.trend > 0 else (-math.inf if self.trend < 0 else 0.0)
        return self.trend / self.se

    @property
    def resolved(self) -> bool:
        """Its fall is beyond the rounding of the dtype its loss is computed in."""
        p = self.progress
        return p is not None and self.floor is not None and p > self.floor

    @classmethod
    def of(cls, curve: Mapping[int, float], window: int = WINDOW, confidence: float = CONFIDENCE) -> Reference:
        """O0's curve {step: loss}: its progress, its noise, and the basis that follows (module docstring)."""
        steps = sorted(curve)
        values = [curve[s] for s in steps]
        ends = _ends(values, window)
        if len(values) < 3 or ends is None or not all(math.isfinite(v) for v in values):
            return cls(dict(curve), Basis.LEVEL, window=window, confidence=confidence)
        first, last = ends
        w = ends_window(len(values), window)
        nz = noise_of(values)
        line = trend([float(s) for s in steps], values)
        assert nz is not None and line is not None
        dtype = resolution.dtype_of(values)
        needed = t_quantile(confidence, nz.dof)
        ref = cls(dict(curve), Basis.LEVEL, first, last, nz.sigma, window, w, nz.sigma * line.se_unit,
                  needed, confidence, line.fall, str(dtype).replace("torch.", ""),
                  resolution.floor(max(abs(first), abs(last)), dtype))
        z = ref.significance
        falls = first - last > 0 and z is not None and z >= needed and ref.resolved
        return replace(ref, basis=Basis.PROGRESS) if falls else ref

    def scale(self, value: float) -> float:
        """The denominator at a step where O0's smoothed loss is `value`."""
        progress = self.progress
        if self.basis is Basis.PROGRESS and progress is not None:  # PROGRESS: O0's curve has both ends
            return progress
        return max(abs(value), TINY)

    def _fall(self) -> str:
        return (f"its loss falls {self.progress:.4g} over the run, from {self.first:.4g} to {self.last:.4g} "
                f"({self.ends}-loss means)")

    def _z(self) -> str:
        z = self.significance
        if z == math.inf:
            return "a noiseless fall"
        return f"its trend's fall is {z:.3g} standard errors ({self.se:.3g}) of its own noise"

    def why_not(self) -> str:
        """Why O0 made no detectable progress (for `Basis.LEVEL`)."""
        if self.progress is None or self.trend is None:
            return "too few finite losses to read a fall from"
        if self.progress <= 0 or self.trend <= 0:
            return (f"its loss does not fall: {self.first:.4g} to {self.last:.4g} over the run, "
                    f"{self.ends}-loss means")
        if not self.resolved:
            unit = self.floor / resolution.RESOLUTION_ULPS if self.floor else 0.0
            return (f"{self._fall()}: within {resolution.RESOLUTION_ULPS} ulps of {self.dtype} at its level "
                    f"({unit:.3g} each), a fall its own rounding can make, not progress it can witness")
        return f"{self._fall()}: {self._z()}, {self.needed:.2g} needed at {self.confidence:.0%} confidence"

    def describe(self) -> str:
        """One line for footnotes: what the deviation is relative to, with the figures."""
        if self.basis is Basis.PROGRESS:
            return f"relative to O0's progress ({self._fall()}; {self._z()})"
        return f"relative to O0's loss level at each step (no detectable progress: {self.why_not()})"

    def no_progress(self, steps: int | None) -> str:
        """tune's message when O0 made no detectable progress."""
        n = "its" if steps is None else str(steps)
        return (f"run more steps: O0 made no detectable progress in {n} steps ({self.why_not()}). No candidate can "
                "be judged against a reference that did not learn: give tune more steps (--steps) or more time "
                "(--budget), or a run whose loss falls beyond its batch-to-batch noise.")

    def to_dict(self) -> dict[str, object]:
        z = self.significance
        return {"basis": self.basis.value, "first": self.first, "last": self.last, "progress": self.progress,
                "noise": self.noise, "se": self.se, "significance": None if z is None or not math.isfinite(z) else z,
                "needed": self.needed, "confidence": self.confidence, "window": self.window, "ends": self.ends,
                "trend": self.trend, "dtype": self.dtype, "floor": self.floor}


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


def _gaps(losses: Mapping[int, float], ref: Reference, skipped: Sequence[int], window: int,
          per_step: int) -> list[tuple[float, int]] | float | None:
    """Per compared step: (|our window mean - O0's| / the reference's scale, the losses in the
    window); inf when a compared loss is not finite, None when no step compares."""
    paired = _paired(losses, ref.curve, skipped, per_step)
    if paired is None:
        return math.inf
    common, k = paired
    ours = _smoothed({s: losses[s] for s in common}, window)
    theirs = _smoothed({s - k: ref.curve[s - k] for s in common}, window)
    gaps = []
    for i, (step, value) in enumerate(ours.items()):
        r = theirs[step - k]
        if not math.isfinite(r):
            return math.inf
        gaps.append((abs(value - r) / ref.scale(r), min(i + 1, window)))
    return gaps or None


def gap_curve(losses: Mapping[int, float], reference: Mapping[int, float] | Reference, skipped: Sequence[int] = (),
              window: int = WINDOW, per_step: int = 1) -> list[tuple[int, float]]:
    """(step, signed gap) at each compared step: ``(mean(L, window) - mean(R, window)) / scale``,
    the deviation before its absolute value and maximum (what ``compare --plot`` draws); empty
    when no step compares or a compared loss is not finite."""
    ref = _reference(reference, window)
    paired = _paired(losses, ref.curve, skipped, per_step)
    if paired is None:
        return []
    common, k = paired
    ours = _smoothed({s: losses[s] for s in common}, window)
    theirs = _smoothed({s - k: ref.curve[s - k] for s in common}, window)
    return [(s, (v - theirs[s - k]) / ref.scale(theirs[s - k])) for s, v in ours.items()
            if math.isfinite(theirs[s - k])]


def deviation(losses: Mapping[int, float], reference: Mapping[int, float] | Reference, skipped: Sequence[int] = (),
              window: int = WINDOW, per_step: int = 1) -> float | None:
    """The deviation of the curve `losses` ({step: loss}) from O0's `reference` (its curve or
    its `Reference`); `skipped`: the run's skipped optimizer steps, whose leading streak is
    shifted out, `per_step` losses each (see the module docstring). None when no step compares."""
    gaps = _gaps(losses, _reference(reference, window), skipped, window, per_step)
    return gaps if not isinstance(gaps, list) else max(g for g, _ in gaps)


def learned(losses: Mapping[int, float], reference: Mapping[int, float] | Reference, skipped: Sequence[int] = (),
            window: int = WINDOW, per_step: int = 1) -> float | None:
    """The share of O0's progress the curve `losses` makes over the same updates (1.0: as much
    as O0, 0: none, negative: its loss rose). None when O0 makes no detectable progress
    (`Basis.LEVEL`), a loss is not finite or the curves share too few steps."""
    return against(losses, reference, skipped, window, per_step).learned


@dataclass(frozen=True)
class Comparison:
    """A run against O0 on the same batches (module docstring): the deviation; the share of O0's
    progress it makes, with that share's standard error; the deviation's noise allowance at a
    full window, and how far the deviation goes beyond the allowance at its own step (both
    relative to O0's progress, like the deviation)."""

    deviation: float | None
    learned: float | None = None
    learned_se: float | None = None
    learned_dof: float | None = None
    noise: float | None = None
    beyond: float | None = None
    unresolved: str | None = None   # why this run's own loss cannot witness O0's progress (None: it can)

    def learned_margin(self, confidence: float = CONFIDENCE) -> float | None:
        """The one-sided t quantile times the share's standard error: at `confidence`, the share
        is at least `learned - learned_margin()` (and at most `learned + learned_margin()`)."""
        if self.learned_se is None or self.learned_dof is None:
            return None
        return t_quantile(confidence, self.learned_dof) * self.learned_se if self.learned_se > 0 else 0.0


def against(losses: Mapping[int, float], reference: Mapping[int, float] | Reference, skipped: Sequence[int] = (),
            window: int = WINDOW, per_step: int = 1, confidence: float = CONFIDENCE) -> Comparison:
    """The curve `losses` against O0's `reference` on the same batches (module docstring)."""
    ref = _reference(reference, window)
    gaps = _gaps(losses, ref, skipped, window, per_step)
    dev = gaps if not isinstance(gaps, list) else max(g for g, _ in gaps)
    paired = _paired(losses, ref.curve, skipped, per_step)
    progress = ref.progress
    if ref.basis is not Basis.PROGRESS or not isinstance(gaps, list) or paired is None or progress is None:
        return Comparison(dev)
    common, k = paired
    ours = [losses[s] for s in common]
    theirs = [ref.curve[s - k] for s in common]
    e_ours, e_theirs = _ends(ours, window), _ends(theirs, window)
    if e_ours is None or e_theirs is None or e_theirs[0] - e_theirs[1] <= 0:
        return Comparison(dev)
    fall = e_theirs[0] - e_theirs[1]
    share = (e_ours[0] - e_ours[1]) / fall
    diff = [a - b for a, b in zip(ours, theirs)]
    d2r, d2d = second_differences(theirs), second_differences(diff)
    if not d2r:
        return Comparison(dev, share)
    m = len(d2r)
    var_r = sum(x * x for x in d2r) / (6.0 * m)
    var_d = sum(x * x for x in d2d) / (6.0 * m)
    cov = sum(x * y for x, y in zip(d2r, d2d)) / (6.0 * m)
    w = ends_window(len(common), window)
    var_share = ((1 - share) ** 2 * var_r + var_d + 2 * (1 - share) * cov) * (2.0 / w) / fall ** 2
    dof = m * noise.SECOND_DIFF_DOF
    # how far a window mean of D strays by D's noise alone, at `confidence` over every compared step
    q = t_quantile(1.0 - (1.0 - confidence) / (2.0 * len(common)), dof)
    unit = q * math.sqrt(var_d) / progress
    beyond = max(g - unit / math.sqrt(n) for g, n in gaps)
    return Comparison(dev, share, math.sqrt(max(var_share, 0.0)), dof, unit / math.sqrt(window), max(0.0, beyond),
                      _unresolved(ours, fall))


def _unresolved(values: Sequence[float], fall: float) -> str | None:
    """Why a run's loss, computed in the dtype its values show, cannot witness O0's `fall` (None: it can)."""
    dtype = resolution.dtype_of(values)
    level = max(abs(v) for v in values)
    if resolution.resolves(fall, level, dtype):
        return None
    name = str(dtype).replace("torch.", "")
    return (f"its loss is computed in {name} ({resolution.ulp(level, dtype):.3g} apart at {level:.3g}): O0's fall "
            f"of {fall:.3g} is within {resolution.RESOLUTION_ULPS} of its ulps")


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
        w = ends_window(len(steps), window)
        return (f"its loss rises from {ends[0]:.4g} to {ends[1]:.4g} over the run ({w}-loss means): it "
                "diverges")
    return None
