"""``tune --plot``: every candidate as its speed-up (bytes per parameter, with the memory
objective) against its deviation from O0, the tolerance as a line, failures marked with
their reason, the runs that cannot tell marked as such, and the chosen policy named (needs
matplotlib: ampatch[plot])."""
from __future__ import annotations

import math
import re

from ampatch.tune.candidates import REFERENCE
from ampatch.tune.measure import Measured
from ampatch.tune.result import Result

__all__ = ["write_plot", "short_reason"]

REASON_CHARS = 48
STYLE = {"qualifies": dict(marker="o", color="tab:green"), "fails": dict(marker="X", color="tab:red"),
         "cannot tell": dict(marker="D", color="0.5")}


def short_reason(reason: str) -> str:
    """The first clause of a verdict's reason, for a label."""
    first = re.split(r"; | \(", reason, maxsplit=1)[0]
    return first if len(first) <= REASON_CHARS else first[:REASON_CHARS - 1] + "…"


def _y(result: Result, m: Measured) -> float | None:
    if result.objective == "memory":
        return m.row.train_bytes_per_param
    o0, ms = result.step_ms(REFERENCE), result.step_ms(m.candidate) or m.step_ms
    return o0 / ms if o0 and ms else None


def write_plot(path: str, result: Result, title: str) -> None:
    """The figure (module docstring). Raises ImportError without matplotlib."""
    from matplotlib.figure import Figure  # optional dependency: ampatch[plot]

    fig = Figure(figsize=(11, 6), layout="constrained")
    ax = fig.subplots(1, 1)
    tol = 100 * result.tolerance
    finite = [100 * m.deviation for m in result.candidates if m.deviation is not None and math.isfinite(m.deviation)]
    right = max([4 * tol, *finite]) * 1.5
    ax.axvspan(0, tol, color="0.88", zorder=0)
    ax.axvline(tol, color="k", ls="--", lw=1, label=f"tolerance {tol:.0f}% (beyond each policy's noise)")
    if result.reference is not None:
        y0 = result.reference.row.train_bytes_per_param if result.objective == "memory" else 1.0
        if y0 is not None:
            ax.scatter([0], [y0], marker="s", color="k", zorder=3, label="O0 (reference)")
    seen: set[str] = set()
    labels: dict[tuple[float, float], list[tuple[str, str]]] = {}   # points that coincide share one label
    for m in result.candidates:
        y = _y(result, m)
        if y is None:
            continue
        dev = m.deviation
        x = 100 * dev if dev is not None and math.isfinite(dev) else right
        outcome = m.outcome.value
        style = STYLE[outcome]
        ax.scatter([x], [y], s=70, zorder=3, label=None if outcome in seen else outcome, marker=style["marker"],
                   color=style["color"])
        seen.add(outcome)
        text = m.candidate.label + ("" if m.qualifies else f": {m.verdict_label}, {short_reason(m.reason)}")
        labels.setdefault((round(x, 2), round(y, 2)), []).append((text, "k" if m.qualifies else style["color"]))
        if result.chosen == m.candidate and not result.cannot_tell:
            ax.scatter([x], [y], s=400, facecolors="none", edgecolors="tab:green", lw=2, zorder=4)
            ax.annotate("chosen", (x, y), xytext=(-12, -18), textcoords="offset points", fontsize=9,
                        color="tab:green", weight="bold")
    for (x, y), texts in labels.items():
        near_right = x > tol * 4   # far right: the label goes to the left of its point
        ax.annotate("\n".join(t for t, _ in texts), (x, y), xytext=(-8 if near_right else 8, 4),
                    textcoords="offset points", fontsize=7, color=texts[0][1], ha="right" if near_right else "left")
    ax.set_xscale("symlog", linthresh=max(tol, 1e-3))
    ax.set_xlim(-0.1 * tol, right * 1.3)
    ticks = [t for t in (0, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if t <= right * 1.3]
    ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
    ys = [y for y in (_y(result, m) for m in result.candidates if m.qualifies) if y is not None]
    if ys and result.spread and result.objective != "memory":
        top = max(ys)
        ax.axhspan(top * (1 - result.spread), top, color="tab:green", alpha=0.07, zorder=0,
                   label=f"within the {result.spread:.0%} spread of the fastest: a tie (the simpler wins)")
    ylabel = "bytes per trained parameter (fewer is better)" if result.objective == "memory" else \
        "speed-up over O0 (re-timed, interleaved, where it was)"
    ax.set(xlabel="deviation from O0, % of O0's progress (log beyond the tolerance; right edge: not finite)",
           ylabel=ylabel)
    if result.objective != "memory":
        ax.axhline(1.0, color="k", lw=0.6)
    chosen = "cannot tell (no policy chosen)" if result.cannot_tell else \
        f"chosen: {(result.chosen or REFERENCE).label}" + (
            f" (spread between repeats {result.spread:.0%}: faster only beyond it)" if result.spread else "")
    ax.set_title(chosen, fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
