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
That scatter is read from the curve's second differences (a smooth trend cancels in them;
for independent noise of spread σ, ``L[s+2] - 2 L[s+1] + L[s]`` has variance 6σ²), so P has
a standard error σ √(2 / ends). O0 *makes progress* when P exceeds that standard error by the
one-sided Student-t quantile at `CONFIDENCE` (its degrees of freedom: the effective number of
second differences). When it does not, nothing can be learned a share of: the deviation is
then relative to O0's level at each step (`Basis.LEVEL`, what ``compare`` shows), and
``tune`` stops ("run more steps").

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
  holds `beyond` to the tolerance, and refuses to judge a run whose noise alone exceeds it.

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
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["WINDOW", "ENDS", "TOLERANCE", "CONFIDENCE", "MIN_SHARE", "DIVERGE", "Basis", "Noise", "Reference",
           "Comparison", "initial_backoffs", "losses_per_step", "deviation", "learned", "against", "unsound",
           "ends_window", "noise_of", "t_quantile"]

WINDOW = 5          # losses averaged at each step before comparing (the compare table's final-loss window)
ENDS = 8            # P: the mean of the first and of the last 1/ENDS of the curve (at least WINDOW losses each)
TOLERANCE = 0.02    # tune's default --tolerance; diagnose holds a verified fix to it
CONFIDENCE = 0.99   # one-sided confidence of every test here: O0's progress, a run's share of it, the noise allowance
MIN_SHARE = 0.5     # tune: a run must learn between this share of O0's progress and its inverse (at CONFIDENCE)
DIVERGE = 1.0       # a positive O0 loss ending this share above where it started (doubled): the reference diverges
TINY = 1e-12        # a reference loss this close to 0 is compared against this instead
SECOND_DIFF_DOF = 18 / 35   # degrees of freedom per second difference of independent noise (1 / sum of rho_k^2)


class Basis(enum.Enum):
    """What a deviation is relative to."""

    PROGRESS = "progress"   # O0's loss falls beyond its noise: how far it falls over the run
    LEVEL = "level"         # it does not: O0's loss at each step


# ------------------------------------------------------------------ statistics
def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b) (continued fraction, modified Lentz)."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - _betainc(b, a, 1.0 - x)
    tiny = 1e-300
    c, d = 1.0, 1.0 / (1.0 - (a + b) * x / (a + 1.0) or tiny)
    h = d
    for m in range(1, 500):
        for aa in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 / (1.0 + aa * d or tiny)
            c = 1.0 + aa / c or tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-14:
            break
    return math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) * h / a


def _t_cdf(t: float, dof: float) -> float:
    tail = 0.5 * _betainc(dof / 2.0, 0.5, dof / (dof + t * t))
    return 1.0 - tail if t >= 0 else tail


@functools.lru_cache(maxsize=4096)
def t_quantile(p: float, dof: float) -> float:
    """The one-sided Student-t quantile: P(T <= t) = p for `dof` degrees of freedom (real, > 0;
    inf: the normal's); for 0.5 <= p < 1."""
    if not 0.5 <= p < 1.0:
        raise ValueError(f"p must be in [0.5, 1), got {p}")
    normal = dof == math.inf or dof > 1e7
    cdf = (lambda t: 0.5 * math.erfc(-t / math.sqrt(2))) if normal else (lambda t: _t_cdf(t, dof))
    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, hi * 2.0
        if hi > 1e300:
            return math.inf
    while hi - lo > 1e-10 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Noise:
    """The per-loss noise of a curve (σ, from its second differences) and its degrees of freedom."""

    sigma: float
    dof: float


def _second(values: Sequence[float]) -> list[float]:
    return [values[i + 2] - 2.0 * values[i + 1] + values[i] for i in range(len(values) - 2)]


def noise_of(values: Sequence[float]) -> Noise | None:
    """The scatter of a curve around its trend: σ with E[(second difference)²] = 6σ²; None for
    fewer than 3 values."""
    d2 = _second(values)
    if not d2:
        return None
    return Noise(math.sqrt(sum(x * x for x in d2) / (6.0 * len(d2))), len(d2) * SECOND_DIFF_DOF)


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
    """O0's curve read once: what it learns over the run, whether that is beyond its own noise,
    and so what a deviation is relative to."""

    curve: Mapping[int, float]
    basis: Basis
    first: float | None = None      # mean of its first `ends` losses
    last: float | None = None       # ... of its last
    noise: float | None = None      # σ: the per-loss scatter around its trend (second differences)
    window: int = WINDOW            # the deviation's smoothing window
    ends: int | None = None         # losses in each of the first and last means
    se: float | None = None         # standard error of the progress: σ √(2 / ends)
    needed: float | None = None     # the t quantile the progress must reach, in standard errors
    confidence: float = CONFIDENCE

    @property
    def progress(self) -> float | None:
        """How far O0's loss falls over the run (first means minus last)."""
        return None if self.first is None or self.last is None else self.first - self.last

    @property
    def significance(self) -> float | None:
        """The progress in standard errors of its own noise (inf: a noiseless fall)."""
        p = self.progress
        if p is None or self.se is None:
            return None
        if self.se == 0:
            return math.inf if p > 0 else (-math.inf if p < 0 else 0.0)
        return p / self.se

    @classmethod
    def of(cls, curve: Mapping[int, float], window: int = WINDOW, confidence: float = CONFIDENCE) -> Reference:
        """O0's curve {step: loss}: its progress, its noise, and the basis that follows (module docstring)."""
        values = [curve[s] for s in sorted(curve)]
        if len(values) < 3 or not all(math.isfinite(v) for v in values):
            return cls(dict(curve), Basis.LEVEL, window=window, confidence=confidence)
        first, last = _ends(values, window)  # type: ignore[misc]
        w = ends_window(len(values), window)
        nz = noise_of(values)
        assert nz is not None
        se = nz.sigma * math.sqrt(2.0 / w)
        needed = t_quantile(confidence, nz.dof)
        ref = cls(dict(curve), Basis.LEVEL, first, last, nz.sigma, window, w, se, needed, confidence)
        z = ref.significance
        falls = first - last > 0 and z is not None and z >= needed
        return cls(dict(curve), Basis.PROGRESS, first, last, nz.sigma, window, w, se, needed, confidence) \
            if falls else ref

    def scale(self, value: float) -> float:
        """The denominator at a step where O0's smoothed loss is `value`."""
        if self.basis is Basis.PROGRESS:
            return self.progress  # type: ignore[return-value]
        return max(abs(value), TINY)

    def _figures(self) -> str:
        z = self.significance
        zt = "a noiseless fall" if z == math.inf else f"{z:.3g} standard errors of its own noise"
        return (f"its loss falls {self.progress:.4g} over the run, from {self.first:.4g} to {self.last:.4g}, "
                f"{self.ends}-loss means; {zt}")

    def why_not(self) -> str:
        """Why O0 made no detectable progress (for `Basis.LEVEL`)."""
        if self.progress is None:
            return "too few finite losses to read a fall from"
        z = self.significance
        if self.progress <= 0:
            return (f"its loss does not fall: {self.first:.4g} to {self.last:.4g} over the run, "
                    f"{self.ends}-loss means")
        return (f"its loss falls {self.progress:.3g} over the run, from {self.first:.4g} to {self.last:.4g} "
                f"({self.ends}-loss means): {z:.2g} standard errors ({self.se:.3g}) of its own noise, "
                f"{self.needed:.2g} needed at {self.confidence:.0%} confidence")

    def describe(self) -> str:
        """One line for footnotes: what the deviation is relative to, with the figures."""
        if self.basis is Basis.PROGRESS:
            return f"relative to O0's progress ({self._figures()})"
        return f"relative to O0's loss level at each step (no detectable progress: {self.why_not()})"

    def no_progress(self, steps: int | None) -> str:
        """tune's message when O0 made no detectable progress."""
        n = "its" if steps is None else str(steps)
        return (f"run more steps: O0 made no detectable progress in {n} steps ({self.why_not()}). No candidate can "
                "be judged against a reference that did not learn: give tune more steps (--steps), or a run whose "
                "loss falls beyond its batch-to-batch noise.")

    def to_dict(self) -> dict[str, object]:
        z = self.significance
        return {"basis": self.basis.value, "first": self.first, "last": self.last, "progress": self.progress,
                "noise": self.noise, "se": self.se, "significance": None if z is None or not math.isfinite(z) else z,
                "needed": self.needed, "confidence": self.confidence, "window": self.window, "ends": self.ends}


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
    if ref.basis is not Basis.PROGRESS or not isinstance(gaps, list):
        return Comparison(dev)
    common, k = _paired(losses, ref.curve, skipped, per_step)  # type: ignore[misc]
    ours = [losses[s] for s in common]
    theirs = [ref.curve[s - k] for s in common]
    e_ours, e_theirs = _ends(ours, window), _ends(theirs, window)
    if e_ours is None or e_theirs is None or e_theirs[0] - e_theirs[1] <= 0:
        return Comparison(dev)
    fall = e_theirs[0] - e_theirs[1]
    share = (e_ours[0] - e_ours[1]) / fall
    diff = [a - b for a, b in zip(ours, theirs)]
    d2r, d2d = _second(theirs), _second(diff)
    if not d2r:
        return Comparison(dev, share)
    m = len(d2r)
    var_r = sum(x * x for x in d2r) / (6.0 * m)
    var_d = sum(x * x for x in d2d) / (6.0 * m)
    cov = sum(x * y for x, y in zip(d2r, d2d)) / (6.0 * m)
    w = ends_window(len(common), window)
    var_share = ((1 - share) ** 2 * var_r + var_d + 2 * (1 - share) * cov) * (2.0 / w) / fall ** 2
    dof = m * SECOND_DIFF_DOF
    # how far a window mean of D strays by D's noise alone, at `confidence` over every compared step
    q = t_quantile(1.0 - (1.0 - confidence) / (2.0 * len(common)), dof)
    unit = q * math.sqrt(var_d) / ref.progress  # type: ignore[operator]
    beyond = max(g - unit / math.sqrt(n) for g, n in gaps)
    return Comparison(dev, share, math.sqrt(max(var_share, 0.0)), dof, unit / math.sqrt(window), max(0.0, beyond))


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
