"""The ``--plot`` figure: loss curves and loss scale per level (needs matplotlib: ampatch[plot])."""

from __future__ import annotations

from collections.abc import Sequence

from ampatch.runs.stats import RunStats

LINE_STYLES = ("-", "--", "-.", ":")
SCALER = "loss_scaler0"


def write_plot(path: str, rows: Sequence[RunStats], title: str) -> None:
    """Two panels: loss per step, loss scale per step (log y). Raises ImportError without
    matplotlib, OSError/ValueError for a path it cannot write."""
    from matplotlib.figure import Figure  # optional dependency: ampatch[plot]

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax_loss, ax_scale = fig.subplots(1, 2)
    for i, row in enumerate(r for r in rows if r.ok):
        style = dict(label=row.level, ls=LINE_STYLES[i % len(LINE_STYLES)], lw=1.2)
        every = row.losses_every
        ax_loss.plot(range(0, len(row.losses) * every, every), row.losses, **style)
        points = sorted(map(tuple, row.loss_scale_history.get(SCALER, [])))
        if points:
            last = max((len(row.losses) - 1) * every, points[-1][0])
            xs, ys = zip(*points, (last, points[-1][1]))
            ax_scale.step(xs, ys, where="post", **style)
    ax_loss.set(title="loss", xlabel="step", ylabel="loss")
    ax_scale.set(title=f"loss scale ({SCALER})", xlabel="step", yscale="log")
    for ax in (ax_loss, ax_scale):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
