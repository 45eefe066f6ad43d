"""The search's result as text (the table, the choice and how to apply it), as ``--json``,
and as the policy file."""
from __future__ import annotations

import datetime
import json
import math
from pathlib import Path
from typing import Any

import torch

from ampatch.config.policy_file import Policy
from ampatch.machine.hardware import fingerprint
from ampatch.runs.deviation import CONFIDENCE, ENDS, MIN_SHARE, WINDOW
from ampatch.tune.candidates import REFERENCE, Candidate
from ampatch.tune.choice import undecided_decider
from ampatch.tune.search import Result

__all__ = ["render", "to_json", "policy_of", "write_json", "title", "outcome", "MEASURE", "NOISE"]

MEASURE = (f"max over steps of |candidate - O0| ({WINDOW}-loss means, compared update for update after the loss "
           f"scaler's initial back-offs) / O0's progress (the mean of its first losses minus the mean of its last: "
           f"1/{ENDS} of the run each, at least {WINDOW}). O0 must make progress beyond its own noise (its "
           f"least-squares trend, one-sided t test at {CONFIDENCE:.0%} confidence, the noise from the second "
           f"differences of its curve) and beyond a few ulps of its loss's dtype, else tune runs longer, then asks the "
           f"weights. A candidate qualifies when it learns between {MIN_SHARE:.0%} and {1 / MIN_SHARE:.0%} of what O0 "
           f"learns at {CONFIDENCE:.0%} confidence, its noise allowance is within the tolerance, and its deviation "
           f"goes no more than the tolerance beyond that allowance; where the loss cannot tell, on its weights (the "
           f"same band for how far they went O0's way, the tolerance for how close they stay); else the runs cannot "
           f"tell.")
NOISE = ("from each run itself: O0's scatter around its trend (second differences of its curve) for its progress; "
         "for a candidate, its paired per-step differences from O0 on the same batches (batch effects cancel): the "
         "standard error of its share of O0's progress (learned_margin: the one-sided t margin at the confidence), "
         "and the deviation its differences reach by noise alone at the confidence over every compared step "
         "(noise, relative to O0's progress). A rerun of O0 with the same seed and data is deterministic on a CPU "
         "and measures nothing: there is none.")


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x) and spec != "s") else format(x, spec)


def _speedup(result: Result, c: Candidate) -> float | None:
    o0, ms = result.step_ms(REFERENCE), result.step_ms(c)
    return o0 / ms if o0 and ms else None


def outcome(result: Result) -> str:
    """How the search ended: "chosen", "cannot tell", "no reference" or "interrupted"."""
    if result.interrupted is not None:
        return "interrupted"
    if result.no_reference:
        return "no reference"
    return "cannot tell" if result.cannot_tell else "chosen"


def title(what: str, result: Result) -> str:
    """The first line: what ran, and the steps (each length O0 ran at, when the runs grew)."""
    steps = result.steps
    runs = (f"{steps[-1]} steps per run" if len(steps) <= 1 else
            f"{steps[0]} steps per run at first, then {', '.join(map(str, steps[1:]))} where the runs could not tell")
    return f"ampatch tune: {what}, {runs}"


def to_json(result: Result) -> dict[str, Any]:
    """`outcome`, `reason`, `decide`, `tolerance`, `reference` (O0's step_ms, final_loss),
    `candidates`, `chosen`, and more."""
    o0 = result.step_ms(REFERENCE)
    ref = result.reference
    cands = []
    for m in result.candidates:
        d = m.to_dict(o0)
        d["step_ms"] = result.step_ms(m.candidate) or d["step_ms"]
        d["speedup"] = _speedup(result, m.candidate)
        cands.append(d)
    chosen = None
    if result.chosen is not None and not result.cannot_tell:
        c = result.chosen
        base = next((d for d in cands if d["opt_level"] == c.opt_level and d["keep_fp32"] == list(c.keep_fp32)
                     and d["half_dtype"] == c.half_dtype and d["loss_scale"] == c.loss_scale
                     and d["master_weights"] == c.master_weights and d["fp8"] == c.fp8
                     and d["fp8_exclude"] == list(c.fp8_exclude)), None)
        chosen = base or {"opt_level": "O0", "half_dtype": None, "keep_fp32": [], "loss_scale": None,
                          "master_weights": None, "fp8": None, "fp8_modules": None, "step_ms": o0,
                          "speedup": 1.0 if o0 else None, "deviation": 0.0, "learned": 1.0, "finite": True,
                          "qualifies": True, "reason": "the reference (FP32)"}
        chosen = {**chosen, "why": result.why}
    basis = result.basis
    decide = result.decide or undecided_decider(result)
    if result.stopped is not None:
        reason = result.stopped
    else:
        reason = result.why
    return {"outcome": outcome(result), "reason": reason,
            "decide": None if decide is None else {"steps": decide.steps, "tolerance": decide.tolerance},
            "steps_tried": result.steps,
            "tolerance": result.tolerance, "objective": result.objective,
            "deviation": {"measure": MEASURE, "basis": basis.basis.value if basis else None,
                          "o0_progress": basis.progress if basis else None, "o0_first": basis.first if basis else None,
                          "o0_last": basis.last if basis else None, "o0_noise": basis.noise if basis else None,
                          "o0_progress_se": basis.se if basis else None,
                          "o0_trend": basis.trend if basis else None, "o0_dtype": basis.dtype if basis else None,
                          "o0_floor": basis.floor if basis else None,
                          "o0_significance": _finite(basis.significance) if basis else None,
                          "o0_needed": basis.needed if basis else None, "confidence": CONFIDENCE,
                          "window": WINDOW, "ends": basis.ends if basis else None, "min_learned": MIN_SHARE,
                          "noise_measured_by": NOISE},
            "reference": {"step_ms": o0, "final_loss": ref.row.final_loss if ref else None,
                          "peak_memory_mib": ref.row.peak_memory_mib if ref else None,
                          "train_bytes_per_param": ref.row.train_bytes_per_param if ref else None},
            "candidates": cands, "chosen": chosen, "spread": result.spread,
            "timings_ms": result.timings, "repeats_ms": result.repeats,
            "interrupted": result.interrupted is not None, "notes": result.notes}


def policy_of(result: Result, steps: int, what: str, device: str) -> Policy:
    """The chosen policy with what it was measured on."""
    c = result.chosen or REFERENCE
    m = result.measured_of(c)
    return c.policy({"tolerance": result.tolerance, "steps": steps, "speedup": _speedup(result, c),
                     "deviation": m.deviation if m is not None else None,
                     "noise": m.noise if m is not None else None,
                     "machine": fingerprint(device).to_dict(),
                     "torch": torch.__version__, "what": what,
                     "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")})


def render(result: Result, title: str, out_path: str | None, rerun: str, command: str = "python train.py") -> str:
    """The table of every candidate, the choice with its reason, and how to apply it (`command`:
    the user's command line, for the AMPATCH_POLICY line)."""
    o0 = result.step_ms(REFERENCE)
    header = ["policy", "step ms", "speed-up", "peak MiB", "B/param", "final loss", "deviation", "learns", "steps",
              "verdict"]
    rows = []
    if result.reference is not None:
        r = result.reference.row
        rows.append(["O0 (reference)", _fmt(o0, ".1f"), "1.00x", _fmt(r.peak_memory_mib, ".0f"),
                     _fmt(r.train_bytes_per_param, ".1f"), _fmt(r.final_loss, ".4f"), "-", "-", _fmt(r.steps, "d"),
                     "reference"])
    for m in result.candidates:
        c = m.candidate
        sp = _speedup(result, c)
        rows.append([c.label, _fmt(result.step_ms(c) or m.step_ms, ".1f"), _fmt(sp, ".2f") + ("x" if sp else ""),
                     _fmt(m.row.peak_memory_mib, ".0f"), _fmt(m.row.train_bytes_per_param, ".1f"),
                     _fmt(m.row.final_loss, ".4f"),
                     "inf" if m.deviation == math.inf else _fmt(m.deviation, ".2%"), _fmt(m.learned, ".0%"),
                     _fmt(m.steps, "d"), f"{m.verdict_label}: {m.reason}"])
    widths = [max(len(h), *(len(x[i]) for x in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in (0, len(header) - 1) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [title, line(header), *(line(x) for x in rows), ""]
    if result.spread is not None:
        reps = ", ".join(f"{k}: {'/'.join(f'{v:.0f}' for v in vs)}" for k, vs in result.repeats.items())
        if reps:
            out.append(f"step ms: median per step after warm-up; for the finalists, the median of their runs "
                       f"interleaved with O0's ({reps}); spread between repeats {result.spread:.1%}: a policy is "
                       "faster only beyond it.")
        else:
            out.append(f"step ms: median per step after warm-up, one run each (not re-timed): a policy is faster "
                       f"only beyond {result.spread:.1%}.")
    basis = result.basis.describe() if result.basis is not None else "relative to O0"
    out.append(f"deviation: largest gap between the loss curve and O0's ({WINDOW}-loss means, update for update "
               f"after the loss scaler's initial back-offs), {basis}; tolerance {result.tolerance:.2%} beyond the "
               f"noise of the policy's own per-step differences from O0 on the same batches ({CONFIDENCE:.0%} "
               f"confidence). learns: the share of O0's progress the policy makes over the same updates; "
               f"unless it is between {MIN_SHARE:.0%} and {1 / MIN_SHARE:.0%} at {CONFIDENCE:.0%} confidence, it "
               "fails, whatever the tolerance. steps: what the verdict rests on. \"can't tell\": neither the loss "
               "(too noisy at the tolerance, or its progress too small to resolve) nor the weights decide; "
               "\"(weights)\": decided on how far the policy's weights went O0's way and how close they stay. "
               "B/param: bytes held per trained parameter for training (weight, master copy or compensation, "
               "optimizer state)"
               + ("; the objective is memory: the fewest B/param wins, speed breaks ties."
                  if result.objective == "memory" else "."))
    out += [f"note: {n}" for n in result.notes]
    if result.cannot_tell:
        out += ["", f"cannot tell: {result.why}"]
    else:
        chosen = result.chosen or REFERENCE
        out += ["", f"chosen: {chosen.label}: {result.why}"]
    if result.interrupted is not None:
        out.append("the policy file was not written (interrupted): run `ampatch tune` again to finish the search.")
    if out_path:
        out += [f"written to {out_path}; apply it with", f"  amp.initialize(model, optimizer, policy={out_path!r})",
                f"  or, without editing the script: {rerun.format(policy=out_path)}",
                f"  or: AMPATCH_POLICY={out_path} {command}"]
    return "\n".join(out)


def write_json(path: str, result: Result) -> None:
    Path(path).write_text(json.dumps(to_json(result), indent=1) + "\n")
