"""The one definition of how far a run's loss curve strays from O0's (its reference).

``compare`` shows it ("max dev vs O0"), ``diagnose`` verifies a fix with it, and ``tune``
holds every candidate to it (``--tolerance``). The deviation of a curve ``L`` from the
reference ``R`` (losses by 0-based optimizer step, as the session's report records them) is

    max over steps s of  |mean(L over the window ending at s) - mean(R over the window ending at s - k)|
                         / |mean(R over the window ending at s - k)|

- ``k`` is the number of the loss scaler's *initial back-offs*: the steps skipped in a row
  from step 0 while a dynamic loss scale falls from its start to a scale that fits. A
  skipped step leaves the weights as they were, so at step ``s`` the run has made ``s - k``
  updates, as O0 had at step ``s - k``: the curves are compared update for update. Without
  this shift one skipped first step makes a steeply falling curve look far off O0's (a
  float16 T5 run whose final loss was within 0.5% of O0's showed a deviation of 0.95).
  The back-off steps themselves are not compared. A step skipped later is not a back-off:
  it is not shifted (and ``tune`` rejects the run for it).
- ``window`` (`WINDOW` losses, fewer at the start) smooths the per-batch noise: once curves
  are shifted, they compare losses of different batches at the same number of updates.
- The deviation is relative (a fraction: 0.02 is 2%), so a tolerance means the same on any
  loss. A non-finite loss makes it infinite. Only the steps both curves have are compared
  and averaged (a long run's curve is thinned, a budget cuts one short); None when none is.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = ["WINDOW", "initial_backoffs", "deviation"]

WINDOW = 5          # losses averaged at each step before comparing (the compare table's final-loss window)
TINY = 1e-12        # a reference loss this close to 0 is compared against this instead


def initial_backoffs(skipped: Sequence[int]) -> int:
    """How many steps were skipped in a row from step 0 (0-based step numbers): the dynamic
    loss scaler's initial back-offs."""
    done = set(skipped)
    k = 0
    while k in done:
        k += 1
    return k


def _smoothed(curve: Mapping[int, float], window: int) -> dict[int, float]:
    """{step: mean of the last `window` losses up to and including that step}, in step order."""
    steps = sorted(curve)
    out: dict[int, float] = {}
    for i, step in enumerate(steps):
        part = [curve[s] for s in steps[max(0, i - window + 1):i + 1]]
        out[step] = sum(part) / len(part)
    return out


def deviation(losses: Mapping[int, float], reference: Mapping[int, float], skipped: Sequence[int] = (),
              window: int = WINDOW) -> float | None:
    """The relative deviation of the curve `losses` from `reference` (both {step: loss});
    `skipped`: the run's skipped steps, whose leading streak is shifted out (see the module
    docstring). None when no step compares."""
    k = initial_backoffs(skipped)
    mine = {s: v for s, v in losses.items() if s >= k}
    if any(not math.isfinite(v) for v in mine.values()):
        return math.inf
    common = [s for s in mine if s - k in reference]   # a thinned curve has only some steps
    if not common and k:  # a long run's thinned curves (every n-th loss) share no step k apart:
        stride = min((b - a for a, b in zip(sorted(reference), sorted(reference)[1:])), default=1)
        k -= k % stride   # shift by whole strides (an update or so off, over thousands of steps)
        common = [s for s in mine if s - k in reference]
    ours = _smoothed({s: mine[s] for s in common}, window)
    theirs = _smoothed({s - k: reference[s - k] for s in common}, window)
    worst = None
    for step, value in ours.items():
        ref = theirs[step - k]
        if not math.isfinite(ref):
            return math.inf
        dev = abs(value - ref) / max(abs(ref), TINY)
        worst = dev if worst is None else max(worst, dev)
    return worst
