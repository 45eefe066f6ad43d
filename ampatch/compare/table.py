"""The comparison table as text, the machine line above it, and the rows as JSON, each level
with the one verdict `tune` and `diagnose` give it (`ampatch.runs.verdict`: qualifies, fails,
or cannot tell) and the noise its deviation is judged beside."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ampatch.machine import hardware
from ampatch.machine.device_text import machine_line, slow_half_note
from ampatch.model.fp8 import EMULATED
from ampatch.runs.deviation import CONFIDENCE, WINDOW
from ampatch.runs.stats import BASELINE, FINAL_LOSS_WINDOW, WARMUP_FRACTION, RunStats
from ampatch.runs.verdict import Rule, Verdict, judge

# (heading, RunStats attribute, format)
COLUMNS = [("level", "level", "{}"), ("half dtype", "half_dtype", "{}"),
           ("step ms", "median_step_ms", "{:.1f}"), ("speed-up", "speedup_vs_O0", "{:.2f}x"),
           ("peak MiB", "peak_memory_mib", "{:.0f}"), ("B/param", "train_bytes_per_param", "{:.1f}"),
           ("first loss", "first_loss", "{:.4f}"),
           ("final loss", "final_loss", "{:.4f}"),
           ("max dev vs O0", "max_loss_dev_vs_O0", "{:.2%}"), ("noise", "noise", "{:.2%}"),
           ("verdict", "verdict", "{}"),
           ("skipped", "skipped_steps", "{}"), ("loss scale", "final_loss_scale", "{:g}"),
           ("steps", "steps", "{}")]
VERDICT_KEYS = ("noise", "verdict")   # columns read from the row's verdict, not from the row
TEXT_COLUMNS = 2   # the first columns are text, left-aligned; numbers are right-aligned
NOTE_WIDTH = 100
EMULATED_MARK = "*"  # after the level of a row whose FP8 was emulated (the footnote says what it means)


def judge_rows(rows: Sequence[RunStats], tolerance: float, upto: int | None = None) -> dict[str, Verdict]:
    """Each finished level's verdict against O0's row (none without an O0 row), as tune judges."""
    base = next((r for r in rows if r.level == BASELINE and r.ok), None)
    if base is None:
        return {}
    ref = base.reference(upto)
    return {r.level: judge(r, Rule(tolerance), ref, upto, base.witness) for r in rows if r is not base}


def cell(row: RunStats, key: str, fmt: str, verdict: Verdict | None = None) -> str:
    """One cell: ``-`` for a missing value; the skipped steps are counted; `VERDICT_KEYS` from `verdict`."""
    if key in VERDICT_KEYS:
        if verdict is None:
            return "reference" if key == "verdict" and row.level == BASELINE else "-"
        value = verdict.label if key == "verdict" else verdict.noise
        return "-" if value is None else fmt.format(value)
    value = getattr(row, key)
    if key == "level" and fp8_emulated(row):
        value = f"{value} {EMULATED_MARK}"
    if key == "skipped_steps":
        value = len(value or [])
    return "-" if value is None else fmt.format(value)


def format_table(rows: Sequence[RunStats], title: str, machine: str | None = None,
                 notes: Sequence[str] = (), verdicts: Mapping[str, Verdict] | None = None,
                 tolerance: float | None = None) -> str:
    """The comparison table with its footnotes, as text: title, the machine line (device,
    torch, half dtype native or not), the table, the footnotes, then ``notes``; `verdicts`
    (`judge_rows`, at `tolerance`) fill the noise and verdict columns."""
    verdicts = verdicts or {}
    ok = [[cell(r, key, fmt, verdicts.get(r.level)) for _, key, fmt in COLUMNS] for r in rows if r.ok]
    widths = [max([len(h)] + [len(c[i]) for c in ok]) for i, (h, _, _) in enumerate(COLUMNS)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < TEXT_COLUMNS or COLUMNS[i][1] == "verdict" else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    out = [title] + ([f"machine: {machine}"] if machine else []) + [line([h for h, _, _ in COLUMNS])]
    cells = iter(ok)
    for row in rows:
        out.append(line(next(cells)) if row.ok else f"{row.level.ljust(widths[0])}  FAILED: {row.error}")
    out += ["",
            f"step ms: median wall time per optimizer step, first {WARMUP_FRACTION:.0%} "
            "of steps skipped as warm-up; speed-up is relative to O0.",
            f"first loss: the first step's; final loss: mean of the last {FINAL_LOSS_WINDOW} losses (all, if fewer); "
            f"max dev: largest gap between the loss curve and O0's ({WINDOW}-step means, compared update for update "
            f"after the loss scaler's initial back-offs), {deviation_basis(rows)}; see ampatch.runs.deviation.",
            "peak MiB: CUDA max allocated when the run used CUDA, else the process's peak RSS; B/param: bytes held "
            "per trained parameter for training (weight, master copy or compensation, optimizer state)."]
    out += [n for n in [verdict_note(verdicts, tolerance)] if n]
    out += [textwrap.fill(n, width=NOTE_WIDTH, subsequent_indent="  ", break_on_hyphens=False)
            for n in [*fp8_notes(rows), *notes] if n]
    return "\n".join(out)


def verdict_note(verdicts: Mapping[str, Verdict], tolerance: float | None) -> str:
    """The footnote of the noise and verdict columns, with what would decide the levels the runs cannot tell."""
    if not verdicts or tolerance is None:
        return ""
    out = (f"noise: how far the deviation strays by the noise of the level's own per-step differences from O0 "
           f"({CONFIDENCE:.0%} confidence); verdict: as tune judges at a {tolerance:.2%} tolerance (ok, FAIL, "
           "\"(weights)\": on how far its weights went O0's way, \"can't tell\": neither the loss nor the weights "
           "decide); --json gives each reason.")
    left = {k: v for k, v in verdicts.items() if not v.judged}
    if left:
        out += " Can't tell: " + "; ".join(f"{k}: {v.decide.describe() if v.decide else 'more steps'} would decide"
                                           for k, v in left.items()) + "."
    return out


def fp8_emulated(row: RunStats) -> bool:
    """Whether the row's run had FP8 layers that torchao emulated (no FP8 tensor cores there)."""
    return row.ok and row.report is not None and bool(row.report.fp8) and row.report.fp8_emulated


def fp8_notes(rows: Sequence[RunStats]) -> list[str]:
    """The footnotes of the rows that ran with FP8: each one's recipe and layers, and for the
    emulated ones (marked) what their figures show: "fp8 emulated: numerics only, not speed"."""
    fp8 = [(r, r.report) for r in rows if r.ok and r.report is not None and r.report.fp8]
    if not fp8:
        return []
    each = []
    for row, rep in fp8:
        converted = sum(1 for layer in rep.fp8_layers if layer.get("converted"))
        each.append(f"{row.level} {rep.fp8} on {converted} of {len(rep.fp8_layers)} Linear layers" if converted else
                    f"{row.level} {rep.fp8}, but on no layer (none could run in FP8: see its report)")
    out = [f"fp8 (torchao): {'; '.join(each)}."]
    emulated = [r.level for r, _ in fp8 if fp8_emulated(r)]
    if emulated:
        out.append(f"{EMULATED_MARK} {EMULATED}: no FP8 tensor cores here, so torchao emulated FP8 (casts to FP8 and "
                   f"back, GEMMs in high precision): the losses of {', '.join(emulated)} show FP8's numerics; "
                   f"{'its' if len(emulated) == 1 else 'their'} step time and speed-up say nothing of FP8's speed.")
    if len(emulated) < len(fp8):
        out.append("FP8 on tensor cores: torchao needs torch.compile for its speed, and ampatch compiles nothing.")
    return out


def deviation_basis(rows: Sequence[RunStats]) -> str:
    """What the "max dev" column is relative to: O0's progress over the run, or its level."""
    base = next((r for r in rows if r.level == BASELINE and r.ok), None)
    return base.reference().describe() if base is not None else "relative to O0's (no O0 row here)"


def interrupted_note(rows: Sequence[RunStats], levels: Sequence[str]) -> str:
    """The note after Ctrl-C: which of the levels finished."""
    return (f"interrupted: {len(rows)} of {len(levels)} levels finished "
            f"({', '.join(r.level for r in rows) or 'none'}).")


def machine_of(rows: Sequence[RunStats], fallback: str = "cpu") -> tuple[str, str | None]:
    """The machine line and the slow-half note for the table, from the runs' reports (the
    device each script trained on); from ``fallback`` here when no report says."""
    device = next((r.report.device for r in rows if r.ok and r.report is not None and r.report.device), None)
    info = device.info if device is not None else hardware.describe(fallback)
    dtypes = list(dict.fromkeys(r.half_dtype for r in rows if r.ok and r.half_dtype))
    return machine_line(info, dtypes), slow_half_note(info, dtypes)


def verdict_dict(v: Verdict | None) -> dict[str, Any] | None:
    """A verdict as the JSON of compare's rows writes it."""
    if v is None:
        return None
    return {"outcome": v.outcome.value, "evidence": v.evidence.value, "reason": v.reason, "noise": v.noise,
            "beyond": v.beyond, "learned": v.learned, "learned_margin": v.learned_margin, "steps": v.steps,
            "decide": None if v.decide is None else {"steps": v.decide.steps, "tolerance": v.decide.tolerance}}


def write_json(path: str, header: dict[str, Any], rows: Sequence[RunStats],
               verdicts: Mapping[str, Verdict] | None = None) -> None:
    """``header`` and all rows, with loss curves, loss-scale history, the full reports and each
    level's verdict."""
    verdicts = verdicts or {}
    data = [{**r.to_dict(), "verdict": verdict_dict(verdicts.get(r.level))} for r in rows]
    Path(path).write_text(json.dumps({**header, "rows": data}, indent=1) + "\n")
