"""The ``--plot`` figure of `compare`: is each level OK? (needs matplotlib: ampatch[plot]).

- **Deviation from O0 over the steps**, each level's signed gap (5-loss means, update for
  update) relative to O0's progress, as `tune` measures it, with the band a level may stay in:
  the tolerance beyond the noise of its own per-step differences from O0 (shaded in its colour,
  dotted edges), and its verdict in the legend. The axis spans a few of those bands; a level
  far off leaves it, and the edge says how far.
- **Speed-up and memory** per level, as bars (speed-up over O0, peak MiB).
- **The loss scale**, only where it moves (a dynamic scale; a bfloat16 run's is 1.0 throughout).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ampatch.runs.deviation import gap_curve, losses_per_step
from ampatch.runs.stats import BASELINE, RunStats, losses_by_step
from ampatch.runs.verdict import Verdict

__all__ = ["write_plot", "scale_moves", "SCALER"]

LINE_STYLES = ("-", "--", "-.", ":")
SCALER = "loss_scaler0"
LINEAR_TOLERANCES = 3   # the deviation axis spans at least this many tolerances either side


def scale_moves(row: RunStats) -> bool:
    """Whether the row's loss scale ever changed (a static or bfloat16 run's stays put)."""
    return len({float(s) for _, s in row.loss_scale_history.get(SCALER, [])}) > 1


def _gaps(row: RunStats, base: RunStats, upto: int | None) -> list[tuple[int, float]]:
    losses = losses_by_step(row.losses, row.losses_every, upto)
    per_step = losses_per_step(len(row.losses) * row.losses_every, row.steps)
    return gap_curve(losses, base.reference(upto), row.skipped_steps, per_step=per_step)


def _deviation_panel(ax: Any, rows: Sequence[RunStats], base: RunStats, verdicts: Mapping[str, Verdict],
                     tolerance: float, upto: int | None) -> None:
    ref = base.reference(upto)
    relative = "O0's progress" if ref.basis.value == "progress" else "O0's loss"
    curves: list[tuple[RunStats, Verdict | None, list[int], list[float]]] = []  # (row, verdict, steps, gaps)
    for row in (r for r in rows if r.ok and r is not base):
        gaps = _gaps(row, base, upto)
        if gaps:
            curves.append((row, verdicts.get(row.level), [step for step, _ in gaps], [gap for _, gap in gaps]))
    bands = [100 * (tolerance + (v.noise or 0.0)) for _, v, _, _ in curves if v is not None]
    limit = max([LINEAR_TOLERANCES * 100 * tolerance, *(1.5 * b for b in bands)])
    ax.axhspan(-100 * tolerance, 100 * tolerance, color="0.82", zorder=0, label=f"tolerance ±{tolerance:.0%}")
    ax.axhline(0, color="k", lw=0.8)
    for i, (row, v, xs, ys) in enumerate(curves):
        label = f"{row.level} ({row.half_dtype or 'FP32'}): {v.label if v else '-'}"
        line, = ax.plot(xs, [100 * y for y in ys], ls=LINE_STYLES[i % len(LINE_STYLES)], lw=1.4, label=label)
        if v is not None and v.noise is not None:
            band = 100 * (v.noise + tolerance)
            ax.fill_between(xs, -band, band, color=line.get_color(), alpha=0.08, lw=0)
            for edge in (-band, band):
                ax.axhline(edge, color=line.get_color(), ls=":", lw=0.8)
        worst = max(ys, key=abs)
        if abs(100 * worst) > limit:   # off the scale: say how far, at the edge it leaves by
            ax.annotate(f"{row.level}: {100 * worst:+.0f}% (off scale)", xy=(xs[-1], limit if worst > 0 else -limit),
                        xytext=(-4, -12 if worst > 0 else 4), textcoords="offset points", ha="right", fontsize=8,
                        color=line.get_color())
    ax.set_ylim(-limit, limit)
    ax.set(title=f"deviation from O0, % of {relative} (shaded, dotted: tolerance + the level's noise)",
           xlabel="step", ylabel=f"% of {relative}")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)


def _bars(ax: Any, rows: Sequence[RunStats], key: str, title: str, reference: float | None) -> None:
    shown = [r for r in rows if r.ok and getattr(r, key) is not None]
    names = [r.level for r in shown]
    values = [getattr(r, key) for r in shown]
    bars = ax.bar(names, values, color=["0.55" if r.level == BASELINE else "tab:blue" for r in shown])
    ax.bar_label(bars, fmt="%.2f" if key == "speedup_vs_O0" else "%.0f", fontsize=8)
    if reference is not None:
        ax.axhline(reference, color="k", lw=0.8)
    ax.set(title=title)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)


def write_plot(path: str, rows: Sequence[RunStats], title: str, verdicts: Mapping[str, Verdict] | None = None,
               tolerance: float = 0.02, upto: int | None = None) -> None:
    """The figure (module docstring). Raises ImportError without matplotlib, OSError/ValueError
    for a path it cannot write."""
    from matplotlib.figure import Figure  # optional dependency: ampatch[plot]

    verdicts = verdicts or {}
    base = next((r for r in rows if r.level == BASELINE and r.ok), None)
    moving = [r for r in rows if r.ok and scale_moves(r)]
    fig = Figure(figsize=(13, 7.5 if moving else 5.5), layout="constrained")
    grid = fig.add_gridspec(2 if moving else 1, 3, width_ratios=(3, 1, 1))
    ax_dev = fig.add_subplot(grid[0, 0])
    if base is not None:
        _deviation_panel(ax_dev, rows, base, verdicts, tolerance, upto)
    else:
        ax_dev.text(0.5, 0.5, "no O0 row: no deviation to draw", ha="center", va="center")
        ax_dev.set_axis_off()
    _bars(fig.add_subplot(grid[0, 1]), rows, "speedup_vs_O0", "speed-up over O0", 1.0)
    _bars(fig.add_subplot(grid[0, 2]), rows, "peak_memory_mib", "peak MiB", None)
    if moving:
        ax_scale = fig.add_subplot(grid[1, :])
        for i, row in enumerate(moving):
            points = sorted(map(tuple, row.loss_scale_history.get(SCALER, [])))
            last = max((len(row.losses) - 1) * row.losses_every, points[-1][0])
            xs, ys = zip(*points, (last, points[-1][1]))
            ax_scale.step(xs, ys, where="post", label=row.level, ls=LINE_STYLES[i % len(LINE_STYLES)])
        ax_scale.set(title=f"loss scale ({SCALER}), the levels where it moves", xlabel="step", yscale="log")
        ax_scale.legend(fontsize=8)
        ax_scale.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
