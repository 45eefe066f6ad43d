"""The diagnosis as text (what `ampatch diagnose` prints) and as a figure (``--plot``).

Columns of the module table, per module over the recorded steps:
- ``out amax``: the largest finite |value| of its outputs; ``headroom``: how many times that
  fits under the half dtype's largest finite number (float16: 65504), below 1x it overflows;
- ``inf/NaN out``: non-finite output elements (a module fed non-finite inputs counts too);
- ``inf/NaN grad``: non-finite elements in the grads reaching it, leaving it, and of its params;
- ``underflow``: the largest share of a parameter's grad, as produced (scaled), that is zero
  or subnormal in the half dtype;
- ``unchanged``: the share of its own weights (with a gradient) each of the later optimizer
  steps left unchanged, on average: near 100% the updates are below the resolution of the
  dtype holding the weights and round away (stalled updates);
- ``rel error``: its local relative error, ``||out - shadow||_2 / ||shadow||_2`` against its
  FP32 shadow (the same call on FP32 inputs with FP32 params and no casts), worst call.

With layers run in FP8, a table of them (`fp8_table`): each against the same GEMMs in
bfloat16 on its own inputs (``out err``, ``wgrad err``: relative errors of the output and
the weight gradient, worst call), and over the recipe's FP8 casts the largest shares of values
that saturate, flush to zero (``flushed``) or land among FP8's subnormals, and whether FP8
hurts it (`diagnose.fp8`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..model.fp8 import EMULATED
from ..runs.deviation import MIN_SHARE, TOLERANCE
from .analysis import blame_line
from .fp8 import Fp8Entry
from .result import Diagnosis, Figures, ModuleEntry, Recommendation
from .stalls import STALL_SHARE

__all__ = ["render", "write_plot", "fp8_table", "MODULE_ROWS"]

MODULE_ROWS = 12  # modules shown in the table (all are in --json)


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _module_rows(modules: Sequence[ModuleEntry]) -> list[list[str]]:
    rows = []
    for m in modules:
        err = "inf" if m.rel_error_inf else _fmt(m.rel_error, ".3g")
        under = None if m.grad_underflow is None else f"{m.grad_underflow:.0%}"
        rows.append([m.name or "(model)", m.type, _fmt(m.out_amax, ".3g"),
                     "-" if m.headroom is None else f"{m.headroom:.3g}x", str(m.out_nonfinite),
                     str(m.grad_nonfinite), under or "-", "-" if m.unchanged is None else f"{m.unchanged:.0%}", err])
    return rows


def _table(header: list[str], rows: list[list[str]], text_columns: int) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(header)] + [line(r) for r in rows]


def _chosen(result: Diagnosis) -> list[ModuleEntry]:
    """The modules the table shows: the top-ranked, plus every module in the recommendation,
    with inf/NaN or stalled, in the ranked order."""
    keep = result.recommendation.keep_fp32
    stalled = {m.name for m in result.stall.modules} if result.stall is not None else set()
    picked = [m for i, m in enumerate(result.modules) if i < MODULE_ROWS or m.name in keep or m.name in stalled
              or m.out_nonfinite or m.grad_nonfinite]
    return picked[:max(MODULE_ROWS, len(keep) + 4)]


def _pct(x: float | None) -> str:
    return "-" if x is None else "0%" if x == 0 else "<0.01%" if x < 1e-4 else f"{x:.2%}"


def fp8_table(layers: Sequence[Fp8Entry]) -> list[str]:
    """The FP8 layers, each against bfloat16 on its own inputs (see the module docstring)."""
    if not layers:
        return []
    first = layers[0]
    where = f", {EMULATED}" if first.emulated else ", on FP8 tensor cores"
    head = (f"fp8 layers ({first.recipe}{where}; each against the same GEMMs in bfloat16 on its own inputs, "
            "worst call; shares: the largest over the recipe's FP8 casts):")
    rows = [[e.name, e.kind, _fmt(e.out_rel_err, ".3g"), _fmt(e.wgrad_rel_err, ".3g"), _pct(e.saturated),
             _pct(e.flushed), _pct(e.subnormal), e.flushed_in or "-",
             "yes" if e.hurts else ("not measured" if not e.calls else "no")] for e in layers]
    table = _table(["layer", "kind", "out err", "wgrad err", "saturated", "flushed", "subnormal", "flushed most in",
                    "FP8 hurts"], rows, 2)
    return ["", head, *("  " + ln for ln in table)]


def _verdict(f: Figures) -> str:
    if f.follows_O0 is None:
        return "can't tell" if f.verdict else "reference"
    return "yes" if f.follows_O0 else "no"


def _verification(result: Diagnosis, level: str) -> list[str]:
    v = result.verification
    assert v is not None
    header = ["run", "finite", "final loss", "max dev vs O0", "learns", "follows O0", "skipped", "steps"]

    def row(label: str, f: Figures) -> list[str]:
        return [label, "yes" if f.finite else "no", _fmt(f.final_loss, ".4f"), _fmt(f.max_dev_vs_O0, ".2%"),
                _fmt(f.learned_vs_O0, ".0%"), _verdict(f), str(f.skipped_steps), str(f.steps)]

    rows = [row(level, v.without)]
    for t in v.tries:
        fix = [f"keep_fp32={list(t.keep_fp32)}"] if t.keep_fp32 else []
        fix += [f"{k}={val!r}" for k, val in t.settings.to_dict().items()]
        fix += [f"{list(t.fp8_exclude)} out of FP8"] if t.fp8_exclude else []
        rows.append(row(f"{level} + {', '.join(fix)}", t))
    rows.append(row("O0", v.O0))
    return _table(header, rows, 1)


def _apply(rec: Recommendation, rerun: str | None) -> list[str]:
    """How to apply a verified recommendation: in code, and (for a script) without editing it."""
    settings = rec.settings.to_dict()
    args = [f"keep_fp32={list(rec.keep_fp32)!r}"] if rec.keep_fp32 else []
    args += [f"{k}={v!r}" for k, v in settings.items()]
    if rec.fp8_modules is not None:
        args.append(f"fp8_modules={list(rec.fp8_modules)!r}" if rec.fp8_modules else "fp8=False")
    lines = [f"apply it: amp.initialize(..., {', '.join(args)})"]
    if rerun is not None:
        options = (f"--keep-fp32 {','.join(rec.keep_fp32)} " if rec.keep_fp32 else "")
        options += (f"--loss-scale {settings['loss_scale']} " if "loss_scale" in settings else "")
        options += (f"--master-weights {settings['master_weights']} " if "master_weights" in settings else "")
        if rec.fp8_modules is not None:
            options += f"--fp8-modules {','.join(rec.fp8_modules)} " if rec.fp8_modules else "--fp8 off "
        lines.append("  or, without editing the script: " + rerun.format(options=options))
    return lines


def _recommendation(result: Diagnosis) -> str:
    rec = result.recommendation
    if not rec and result.step_fault is not None:
        return ("recommendation: no module to keep in FP32: the optimizer step itself made the weights "
                "non-finite (see the note).")
    if not rec:
        return "recommendation: none: no module stands out and nothing went non-finite."
    what = [f"keep_fp32={list(rec.keep_fp32)}"] if rec.keep_fp32 else []
    what += [f"{k}={v!r}" for k, v in rec.settings.to_dict().items()]
    if rec.fp8_exclude:
        left = f"fp8_modules={list(rec.fp8_modules)}" if rec.fp8_modules else "fp8 off: no layer is left"
        what.append(f"leave {list(rec.fp8_exclude)} out of FP8 ({left})")
    why = ""
    if rec.settings.master_weights and result.step_fault is not None:
        why = (" (the optimizer's own step in the half dtype made the weights non-finite: with FP32 masters it steps "
               "FP32 copies; no module to keep in FP32 helps; bfloat16 or a larger eps would do too)")
    return "recommendation: " + ", ".join(what) + why


def render(result: Diagnosis, command: str, rerun: str | None = None) -> str:
    """The diagnosis as the command prints it; `rerun` is the `ampatch run` line that applies
    the fix to an unmodified script, with "{options}" where the fix's options go."""
    level = result.opt_level
    fp8 = result.fp8[0] if result.fp8 else None
    out = [f"ampatch diagnose: {command}", f"level {level}, half dtype {result.half_dtype}"
           + (f", fp8 {fp8.recipe} on {len(result.fp8)} Linear layers" + (f" ({EMULATED})" if fp8.emulated else "")
              if fp8 else "") + f", {result.steps} optimizer steps recorded"]
    if result.crashed:
        out.append(f"note: the run failed after the recorded steps: {result.crashed}")
    first = result.first_nonfinite
    if first is None:
        out.append("first non-finite: none")
    else:
        out.append(f"first non-finite: {first.phase} {first.kind} in {first.module or '(model)'!s} at step "
                   f"{first.step}")
    if result.stall is not None and result.stall.finding:
        out.append(f"stalled updates: {result.stall.unchanged:.0%} of the weights unchanged by each optimizer step "
                   f"({result.stall.held_in} weights, no FP32 masters)")
    shown = _chosen(result)
    out += ["", "modules (leaves ranked by local error against their FP32 shadow, then the others):"]
    out += ["  " + ln for ln in _table(["module", "type", "out amax", "headroom", "inf/NaN out", "inf/NaN grad",
                                        "underflow", "unchanged", "rel error"], _module_rows(shown), 2)]
    hidden = len(result.modules) - len(shown)
    if hidden > 0:
        out.append(f"  ... {hidden} more (all in --json)")
    out += fp8_table(result.fp8)
    out += ["", _recommendation(result)]
    out += [f"  - {n}" for n in result.recommendation.notes]
    v = result.verification
    if v is not None:
        out += ["", f"verification (same seed, each run's steps in its column; follows O0 as tune judges a "
                    f"candidate: finite, learning {MIN_SHARE:.0%} to {1 / MIN_SHARE:.0%} of what O0 learns, deviation "
                    f"within {TOLERANCE:.0%} beyond its own noise, or on its weights where the loss cannot tell; "
                    "runs that cannot tell are made longer, as tune's are):"]
        label = (level or "") + (f"+fp8:{fp8.recipe}" if fp8 else "")
        out += ["  " + ln for ln in _verification(result, label)]
        if v.gave_up:
            out.append("  the fix did not make the run finite: gave up (see the last note).")
        else:
            if v.verified.follows_O0 is False:
                out.append(f"  the fixed run does not follow O0: {v.verified.verdict}.")
            elif v.verified.follows_O0 is None:
                out.append(f"  these runs cannot tell whether the fixed run follows O0, at {v.verified.steps} steps "
                           f"(runs made longer as far as the budget and the script allow): {v.verified.verdict}.")
            out += ["", *_apply(result.recommendation, rerun)]
    return "\n".join(out)


def write_plot(path: str, result: Diagnosis, title: str) -> None:
    """Each leaf module's local error against its FP32 shadow (log scale), with the line above
    which diagnose names a module (`analysis.blame_line`) and the recommended ones in red;
    modules with no error to show (exactly 0, or not measured) are listed, not drawn as bars.
    For float16, whose range can run out, a second panel of headroom to its largest value, with
    the line at 1x (bfloat16's range is FP32's: its headroom says nothing). Raises ImportError
    without matplotlib."""
    from matplotlib.figure import Figure  # optional dependency: ampatch[plot]

    leaves = [m for m in result.modules if m.leaf][:30]
    names = [m.name or "(model)" for m in leaves]
    float16 = result.half_dtype == "float16"
    stalls = result.stall is not None
    panels = 1 + float16 + stalls
    fig = Figure(figsize=(4 + 4 * panels, max(3.0, 0.3 * len(leaves) + 1.8)), layout="constrained")
    axes = list(fig.subplots(1, panels, sharey=True)) if panels > 1 else [fig.subplots(1, 1)]
    ax_err = axes[0]
    kept = set(result.recommendation.keep_fp32)
    colors = ["tab:red" if m.name in kept else "tab:blue" for m in leaves]
    errors = [1e6 if m.rel_error_inf else m.rel_error for m in leaves]
    drawn = [e if e else 0.0 for e in errors]
    ax_err.barh(names, drawn, color=colors)
    shown = [e for e in drawn if e > 0]
    line = blame_line([m for m in result.modules if m.leaf], result.half_dtype)
    low = min([*shown, line]) / 10
    for y, (m, e) in enumerate(zip(leaves, errors)):
        if not e:
            ax_err.text(low * 1.2, y, "0 (exact)" if e == 0.0 else "not measured", va="center", fontsize=7,
                        color="0.4")
        elif m.rel_error_inf:
            ax_err.text(e / 3, y, "inf", va="center", ha="right", fontsize=8, color="white")
    ax_err.axvline(line, color="k", ls="--", lw=1, label=f"named above {line:.3g}")
    ax_err.set(xscale="log", xlim=(low, max([*shown, line]) * 10), title="local relative error vs FP32 shadow",
               xlabel="||out - shadow|| / ||shadow|| (red: recommended for FP32)")
    ax_err.legend(fontsize=8, loc="lower right")
    if float16:
        ax_head = axes[1]
        heads = [m.headroom if m.headroom else 0.0 for m in leaves]
        ax_head.barh(names, [max(h, 1e-3) for h in heads], color=colors)
        ax_head.axvline(1.0, color="k", lw=0.8)
        ax_head.set(xscale="log", title="headroom to float16's largest value (under 1x: overflow)", xlabel="times")
    if stalls:
        ax_stall = axes[-1]
        unchanged = [100 * (m.unchanged or 0.0) for m in leaves]
        stalled = {m.name for m in result.stall.modules} if result.stall is not None else set()
        ax_stall.barh(names, unchanged, color=["tab:red" if m.name in stalled else "tab:blue" for m in leaves])
        ax_stall.axvline(100 * STALL_SHARE, color="k", ls="--", lw=1, label=f"stalled above {STALL_SHARE:.0%}")
        ax_stall.set(xlim=(0, 100), title="weights each step left unchanged (%)", xlabel="% (red: stalled)")
        ax_stall.legend(fontsize=8, loc="lower right")
    ax_err.invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
