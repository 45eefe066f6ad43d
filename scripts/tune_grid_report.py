"""The tune grid's report (scripts/tune_grid.py): its cells as the Markdown table of
docs/tune.md, and the summary lines under it."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ampatch.runs.verdict import Evidence, Outcome

if TYPE_CHECKING:
    from tune_grid import Cell, Judged

__all__ = ["table", "summary", "verdict_word"]


def _pct(x: float | None, spec: str = ".1%") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def verdict_word(j: Judged) -> str:
    word = {"qualifies": "ok", "fails": "FAIL", "cannot tell": "**can't tell**"}[j.outcome]
    on = " (weights)" if j.evidence == Evidence.WEIGHTS.value and j.outcome != Outcome.CANNOT_TELL.value else ""
    return f"{word}{on}{'' if j.right else ' (WRONG)'}"


def _cell_text(j: Judged | None, steps: int) -> str:
    """One level's verdict in a cell of `table` (`steps`: the case's own; more are shown)."""
    if j is None:
        return "-"
    at = f" @{j.steps}" if j.steps != steps else ""
    return f"{verdict_word(j)}{at} {_pct(j.deviation)}, learns {_pct(j.learned, '.0%')}"


def table(cells: list[Cell]) -> str:
    """The grid as a Markdown table (docs/tune.md)."""
    lines = ["| optimizer | lr | steps | noise | steps run | O0 progress / level | O0 t (needed) | O3 stall | O3 | O4 "
             "| O5 |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        k = c.case
        z = "-" if c.o0_significance is None else ("inf" if c.o0_significance == math.inf
                                                   else f"{c.o0_significance:.1f}")
        sig = f"{z} ({c.o0_needed:.1f})" if c.o0_needed is not None else z
        if c.stopped is not None:
            verdicts = ["**can't tell** (O0)", "", ""]
        else:
            by = {j.level: j for j in c.levels}
            verdicts = [_cell_text(by.get(level), c.case.steps) for level in ("O3", "O4", "O5")]
        ran = "→".join(map(str, c.steps))
        lines.append(f"| {k.optimizer} | {k.lr:g} | {k.steps} | {k.noise:g}x | {ran} | {_pct(c.o0_progress, '.2%')} | "
                     f"{sig} | {_pct(c.o3_stall, '.0%')} | " + " | ".join(verdicts) + " |")
    return "\n".join(lines)


def summary(cells: list[Cell], stalled_above: float) -> str:
    """What the grid found, in a few lines; O3 counts as stalled where more than `stalled_above`
    of its weights never change."""
    stopped = [c for c in cells if c.stopped is not None]
    undecided = [c for c in cells if c.cannot_tell]
    judged = [j for c in cells for j in c.levels if j.outcome != Outcome.CANNOT_TELL.value]
    left = [j for c in cells for j in c.levels if j.outcome == Outcome.CANNOT_TELL.value]
    on_weights = [j for j in judged if j.evidence == Evidence.WEIGHTS.value]
    wrong = [(c, j) for c in cells for j in c.levels if not j.right]
    o3 = [j for j in judged if j.level == "O3"]
    stalled = [j for j in o3 if j.stall > stalled_above]
    free = [j for j in o3 if j.stall <= stalled_above]
    longer = [c for c in cells if len(c.steps) > 1]

    def count(js: list[Judged], what: str) -> str:
        return f"{sum(j.expected == what for j in js)} ({sum(j.expected == what and j.right for j in js)} right)"
    out = [f"{len(cells)} cells: {len(undecided)} end in 'cannot tell' ({len(stopped)} of them because O0 showed no "
           f"progress by its loss or its weights); {len(longer)} ran longer than their steps; "
           f"{len(judged)} verdicts given ({len(on_weights)} on the weights), {len(left)} levels the runs could not "
           "tell.",
           f"O3 stalled (most weights never change) in {len(stalled)} verdicts: "
           f"{sum(not j.qualifies for j in stalled)} fail; the old rule passed {sum(bool(j.old) for j in stalled)} of "
           "them.",
           f"O3 not stalled in {len(free)} verdicts: {sum(j.qualifies for j in free)} qualify, "
           f"{sum(not j.qualifies for j in free)} fail.",
           f"expected to qualify (track O0 within half the tolerance): {count(judged, 'qualify')}; to fail: "
           f"{count(judged, 'fail')}; near the tolerance (either is right): "
           f"{sum(j.expected == 'either' for j in judged)}.",
           f"wrong verdicts: {len(wrong)}; time {sum(c.wall_s for c in cells):.0f}s"]
    out += [f"  WRONG: {c.case.label}: {j.level} {'qualifies' if j.qualifies else 'fails'} ({j.reason}); stall "
            f"{j.stall:.0%}, true share {j.true_share:.2f}, true gap {j.true_gap:.3f}" for c, j in wrong]
    return "\n".join(out)
