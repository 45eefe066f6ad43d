"""The weights as a second witness: how far a run's weights went O0's way, and how far they
are from O0's, relative to how far O0's moved, read from the projections each run recorded
(`ampatch.session.witness`; the same seed and batches in every run of a command).

Both runs start from the same weights, so each displacement is taken from its own start (a
half model's start is its rounded copy): ``a = W(T) - W(0)`` for the run, ``b`` the same for
O0, at the last update count both recorded. From the projection's buckets, each an
independent random share of the weights:

- `share`: how far the run moved along O0's way, ``<a, b> / <b, b>`` (1: as far as O0; 0: a
  stalled run whose weights stay where they started), with its one-sided margin at the
  confidence from the spread of the buckets' own estimates (Student's t over the buckets);
- `deviation`: the largest distance between the two runs' displacements at any recorded update
  count, over how far O0's weights moved by the end, ``max_u |a(u) - b(u)| / |b(T)|``, and
  `bound`, its upper confidence bound (Bonferroni over the compared points).

O0's weights witness only what they did: when most of its sampled weights never moved
(`MOVED`: an update below FP32's own resolution, as at a learning rate of 1e-9), its weights
say nothing of learning (`why_not`). The verdict (`ampatch.runs.verdict`) holds `share` to
the same band as the loss's share, and qualifies a run on its weights only when `bound` is
within the tolerance; it never fails a run on its distance alone (a run can reach O0's loss by
other weights).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ampatch.runs.noise import t_quantile
from ampatch.session.witness import Witness

__all__ = ["MOVED", "WeightComparison", "compare"]

MOVED = 0.5   # O0's weights witness learning only when most of them moved (as a stalled run's "most")


@dataclass(frozen=True)
class WeightComparison:
    """A run's weights against O0's (module docstring); `why_not` says why they cannot witness."""

    updates: int
    share: float | None = None
    margin: float | None = None
    deviation: float | None = None
    bound: float | None = None
    moved: float | None = None        # the share of O0's sampled weights that moved from their start
    run_moved: float | None = None    # ... of this run's
    why_not: str | None = None

    @property
    def witnesses(self) -> bool:
        return self.why_not is None and self.share is not None


def _ratio(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Σx / Σy and its standard error, the buckets taken as independent samples (delta method)."""
    total = sum(ys)
    r = sum(xs) / total
    k = len(xs)
    resid = sum((x - r * y) ** 2 for x, y in zip(xs, ys))
    return r, math.sqrt(resid * k / max(k - 1, 1)) / total


def compare(run: Witness | None, reference: Witness | None, confidence: float) -> WeightComparison | None:
    """The run's weights against O0's; None when either recorded no witness (or not the same projection)."""
    if run is None or reference is None or run.dims != reference.dims or run.params != reference.params:
        return None
    common = sorted({p.updates for p in run.points} & {p.updates for p in reference.points})
    if not common or common[0] != 0 or common[-1] == 0:
        return WeightComparison(0, why_not="no update recorded by both runs")
    last = common[-1]
    o0, o0_end, me, me_end = reference.at(0), reference.at(last), run.at(0), run.at(last)
    assert o0 is not None and o0_end is not None and me is not None and me_end is not None
    b = [y - x for x, y in zip(o0.sketch, o0_end.sketch)]
    a = [y - x for x, y in zip(me.sketch, me_end.sketch)]
    base = sum(x * x for x in b)
    if o0_end.moved < MOVED or base <= 0:
        return WeightComparison(last, moved=o0_end.moved, run_moved=me_end.moved,
                                why_not=f"O0's own weights barely moved ({o0_end.moved:.0%} of them changed in {last} "
                                        "updates: its updates are below their resolution), so they witness nothing")
    dof = len(b) - 1
    share, se = _ratio([x * y for x, y in zip(a, b)], [y * y for y in b])
    deviation, bound = 0.0, 0.0
    q = t_quantile(1.0 - (1.0 - confidence) / len(common[1:]), dof)
    for u in common[1:]:
        mine, theirs = run.at(u), reference.at(u)
        assert mine is not None and theirs is not None
        e = [(m - m0) - (t - t0) for m, m0, t, t0 in zip(mine.sketch, me.sketch, theirs.sketch, o0.sketch)]
        d2, d2_se = _ratio([x * x for x in e], [y * y for y in b])
        deviation = max(deviation, math.sqrt(max(d2, 0.0)))
        bound = max(bound, math.sqrt(max(d2 + q * d2_se, 0.0)))
    return WeightComparison(last, share, t_quantile(confidence, dof) * se, deviation, bound, o0_end.moved,
                            me_end.moved)
