"""The statistics under every verdict of `compare`, `tune` and `diagnose`: Student's t
quantiles, the scatter of a loss curve around its trend, and the trend's own fall.

- `noise_of`: σ of a curve's per-loss scatter, read from its second differences
  (``L[s+2] - 2 L[s+1] + L[s]``: a smooth trend cancels; independent noise of spread σ gives
  6σ², with `SECOND_DIFF_DOF` degrees of freedom per difference);
- `trend`: the least-squares line through a curve, and how far it falls over the run with the
  standard error of that fall: every loss counts (weighted by its distance from the middle of
  the run), so for a steady fall the fall grows with the run's length and its standard error
  shrinks, and its t statistic grows as the run does (a mean of the first and last few losses
  does not: its standard error stays that of a few losses);
- `t_quantile`: the one-sided Student-t quantile the tests compare those with.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SECOND_DIFF_DOF", "Noise", "Trend", "second_differences", "noise_of", "trend", "t_quantile"]

SECOND_DIFF_DOF = 18 / 35   # degrees of freedom per second difference of independent noise (1 / sum of rho_k^2)


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


def second_differences(values: Sequence[float]) -> list[float]:
    return [values[i + 2] - 2.0 * values[i + 1] + values[i] for i in range(len(values) - 2)]


def noise_of(values: Sequence[float]) -> Noise | None:
    """The scatter of a curve around its trend: σ with E[(second difference)²] = 6σ²; None for
    fewer than 3 values."""
    d2 = second_differences(values)
    if not d2:
        return None
    return Noise(math.sqrt(sum(x * x for x in d2) / (6.0 * len(d2))), len(d2) * SECOND_DIFF_DOF)


@dataclass(frozen=True)
class Trend:
    """The least-squares line through a curve: its value at the first and the last position, so
    `fall` (first minus last) is how far it falls over the run; `se_unit` times the curve's σ is
    that fall's standard error."""

    first: float
    last: float
    se_unit: float

    @property
    def fall(self) -> float:
        return self.first - self.last


def trend(positions: Sequence[float], values: Sequence[float]) -> Trend | None:
    """The least-squares line through (position, value) pairs (None for fewer than 3)."""
    n = len(values)
    if n < 3 or len(positions) != n:
        return None
    mx, my = sum(positions) / n, sum(values) / n
    sxx = sum((x - mx) ** 2 for x in positions)
    if sxx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(positions, values)) / sxx
    span = positions[-1] - positions[0]
    return Trend(my + slope * (positions[0] - mx), my + slope * (positions[-1] - mx), abs(span) / math.sqrt(sxx))
