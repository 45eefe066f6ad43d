"""From recorded statistics to a diagnosis: where half precision hurts, and what to keep in FP32.

`analyse(doc)` takes what a diagnosed run wrote (see `child.py`: `Recorder.result()` under
"recorded", with the run's level, half dtype and notes) and returns the JSON-ready diagnosis:

- `first_nonfinite`: the first module to produce inf/NaN — in forward, the innermost
  module whose output turned non-finite from finite inputs; in backward, the first module
  (in the order autograd runs) whose grads towards its inputs turned non-finite while the
  grads at its outputs were finite, counted only when it persists to the last recorded step
  (a backward overflow that goes away as a dynamic loss scale backs off is the scaler doing
  its job, and is said so in the notes);
- `modules`: one entry per module, leaves (no child modules) ranked by local relative error,
  largest first, then the others;
- `recommendation`: the smallest set of modules that explains the problem (the first
  non-finite module; leaves whose local error stands far above the rest) as `keep_fp32`,
  `settings` that are not modules (a dynamic loss scale against gradient underflow: when most
  layers underflow, or when one layer's gradient underflows whole, so that it never learns),
  and `notes` in words;
- `step_fault`: an optimizer step that turned finite weights inf/NaN from finite gradients (a
  float16-rounded Adam eps at O3): not a module's precision, so no module is recommended for
  what follows from it (the next forward's inf/NaN).

`diagnosis(doc)` is the same, read once into a typed `Diagnosis` (what `ampatch tune` uses);
`analyse(doc)` is its JSON-ready dict (what `ampatch diagnose` prints and writes).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from ..base.dtypes import from_short_name, is_low
from ..record.stats import headroom

__all__ = ["analyse", "diagnosis", "grow", "Diagnosis", "StepFault", "error_floor", "OUTLIER_FACTOR", "UNDERFLOW_SHARE",
           "FULL_UNDERFLOW"]

OUTLIER_FACTOR = 10.0   # a leaf's error this many times the median leaf's stands out
EPS_MULTIPLE = 32.0     # ... and it must exceed this many machine epsilons of the half dtype
UNDERFLOW_SHARE = 0.5   # a parameter's grad with this share zero/subnormal has underflowed
FULL_UNDERFLOW = 0.99   # ... with this share, the layer never learns: a finding even for one layer


@dataclass(frozen=True)
class StepFault:
    """An optimizer step that made finite weights inf/NaN from finite gradients."""

    step: int
    modules: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class Diagnosis:
    """One recorded run, read once (see the module docstring): the fields `analyse` writes."""

    steps: int
    half_dtype: str | None
    first_nonfinite: dict[str, Any] | None   # {"step", "phase", "module", "kind"}
    modules: list[dict[str, Any]]
    keep_fp32: list[str]
    settings: dict[str, Any]
    notes: list[str]
    step_fault: StepFault | None
    loss: list[float | None]
    loss_scale: list[float]
    skipped_steps: list[int]

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready diagnosis `ampatch diagnose` prints and writes."""
        return {"steps": self.steps, "half_dtype": self.half_dtype, "first_nonfinite": self.first_nonfinite,
                "modules": self.modules,
                "recommendation": {"keep_fp32": list(self.keep_fp32), "settings": dict(self.settings),
                                   "notes": list(self.notes)},
                "step_fault": dataclasses.asdict(self.step_fault) if self.step_fault else None,
                "loss": self.loss, "loss_scale": self.loss_scale, "skipped_steps": self.skipped_steps}


def _half(name: str | None) -> torch.dtype | None:
    """The half dtype a recording names (None when it names none, or FP32)."""
    dtype = from_short_name(name)
    return dtype if dtype is not None and is_low(dtype) else None


def error_floor(half: str | None) -> float:
    """The local relative error below which a module is never blamed: EPS_MULTIPLE machine
    epsilons of the half dtype (float16: 0.031, bfloat16: 0.25)."""
    dtype = _half(half) or torch.bfloat16
    return EPS_MULTIPLE * torch.finfo(dtype).eps


def _rel_error(m: dict[str, Any]) -> float | None:
    errors = m["rel_errors"]
    return max(errors) if errors else None


def _entry(m: dict[str, Any], half: str | None) -> dict[str, Any]:
    err = _rel_error(m)
    amax = m["out_amax"]
    dtype = _half(half)
    return {
        "name": m["name"], "type": m["type"], "leaf": m["leaf"], "calls": m["calls"],
        "out_amax": amax,
        "headroom": headroom(amax, dtype) if dtype is not None else None,
        "out_nonfinite": m["out_nonfinite"],
        "grad_nonfinite": m["grad_in_nonfinite"] + m["grad_out_nonfinite"] + m["param_grad_nonfinite"],
        "grad_underflow": m["grad_underflow"],
        # inf (the half output was not finite, its FP32 shadow was) is written as null, with the count above
        "rel_error": err if err is not None and math.isfinite(err) else None,
        "rel_error_inf": err is not None and not math.isfinite(err),
        "shadow_error": m["shadow_error"],
    }


def _rank_key(e: dict[str, Any]) -> float:
    if e["rel_error_inf"]:
        return math.inf
    return -1.0 if e["rel_error"] is None else e["rel_error"]


def _is_within(name: str, others: list[str]) -> bool:
    """`name` is one of `others` or a submodule of one ("" is the root of a single model)."""
    return any(o == name or o == "" or name.startswith(o + ".") for o in others)


def _persistent_backward(steps: list[dict[str, Any]]) -> tuple[dict | None, list[str]]:
    """The backward culprit of the streak of non-finite backward passes that lasts to the last
    step (None if a later step's backward was clean), and notes on streaks that ended while the
    loss scale backed off. Steps whose forward already went non-finite (a non-finite loss, a
    forward culprit) say nothing about the backward: they neither start nor end a streak."""
    notes = []
    streak_start = None
    for i, s in enumerate(steps):
        if not s["loss_finite"] or s["forward_culprit"] is not None:
            continue
        if s["backward_nonfinite"]:
            streak_start = i if streak_start is None else streak_start
        elif streak_start is not None:
            first = steps[streak_start]
            if s["loss_scale"] < first["loss_scale"]:
                notes.append(f"non-finite gradients from step {first['step']} went away once the loss scale backed "
                             f"off from {first['loss_scale']:g} to {s['loss_scale']:g}: the dynamic loss scaler "
                             "doing its job, not a module to keep in FP32.")
            streak_start = None
    if streak_start is None:
        return None, notes
    culprit = next((s for s in steps[streak_start:] if s["backward_culprit"]), None)
    return culprit, notes


def _step_fault(steps: list[dict[str, Any]]) -> StepFault | None:
    """The first step that left some module's weights inf/NaN although its loss and every
    gradient were finite and it was not skipped."""
    for s in steps:
        bad = s.get("stepped_nonfinite") or []
        if bad and not s["skipped"] and s["loss_finite"] and not s["backward_nonfinite"]:
            names = ", ".join(n or "(model)" for n in bad[:4]) + (" ..." if len(bad) > 4 else "")
            return StepFault(s["step"], tuple(bad), (
                f"step fault: the optimizer step at step {s['step']} made the weights of {names} inf/NaN from finite "
                "gradients: the optimizer's own arithmetic in the half dtype (e.g. an Adam eps that float16 "
                "rounds to 0), not a module's precision; keeping modules in FP32 cannot help: use FP32 "
                "master weights (O2), bfloat16, or a larger eps."))
    return None


def analyse(doc: dict[str, Any]) -> dict[str, Any]:
    """The diagnosis of one recorded run (see the module docstring), JSON-ready."""
    return diagnosis(doc).to_dict()


def diagnosis(doc: dict[str, Any]) -> Diagnosis:
    """The diagnosis of one recorded run (see the module docstring)."""
    raw = doc.get("recorded", doc)
    half = doc.get("half_dtype") or raw.get("half_dtype")
    steps = raw.get("steps", [])
    entries = [_entry(m, half) for m in raw.get("modules", [])]
    leaves = sorted((e for e in entries if e["leaf"]), key=_rank_key, reverse=True)
    others = sorted((e for e in entries if not e["leaf"]), key=_rank_key, reverse=True)
    notes: list[str] = list(doc.get("notes", []))
    settings: dict[str, Any] = {}
    keep: list[str] = []

    first = None
    fault = _step_fault(steps)
    if fault is not None:  # what follows from a faulty step is its consequence, not a module's precision
        notes.append(fault.note)
        steps_before = [s for s in steps if s["step"] <= fault.step]
    else:
        steps_before = steps
    forward = next((s for s in steps_before if s["forward_culprit"] is not None), None)
    backward, scaler_notes = _persistent_backward(steps_before)
    notes += scaler_notes
    if forward is not None:
        first = {"step": forward["step"], "phase": "forward", "module": forward["forward_culprit"],
                 "kind": forward["forward_kind"] or "nonfinite"}
    if backward is not None and (forward is None or backward["step"] < forward["step"]):
        first = {"step": backward["step"], "phase": "backward", "module": backward["backward_culprit"],
                 "kind": "nonfinite gradient"}
    for culprit in (forward, backward):
        if culprit is None:
            continue
        name = culprit["forward_culprit"] if culprit is forward else culprit["backward_culprit"]
        if name is not None and not _is_within(name, keep):
            keep.append(name)

    finite_errors = [e["rel_error"] for e in leaves if e["rel_error"] is not None]
    if finite_errors:
        typical = statistics.median(finite_errors)
        bar = max(error_floor(half), OUTLIER_FACTOR * typical)
        for e in leaves:
            if e["rel_error"] is not None and e["rel_error"] > bar and not _is_within(e["name"], keep):
                keep.append(e["name"])
                notes.append(f"{e['name'] or '(model)'} ({e['type']}): local error {e['rel_error']:.3g} against its "
                             f"FP32 shadow, {e['rel_error'] / max(typical, 1e-30):.0f}x the typical module's "
                             f"{typical:.2g}.")
    # the smallest set: a module inside another kept module is covered by it
    keep = [k for k in keep if not _is_within(k, [o for o in keep if o != k])]

    static_one = bool(steps) and all(s["loss_scale"] == 1.0 for s in steps)
    with_params = [e for e in leaves if e["grad_underflow"] is not None]
    underflowing = [e for e in with_params if e["grad_underflow"] >= UNDERFLOW_SHARE]
    whole = [e for e in with_params if e["grad_underflow"] >= FULL_UNDERFLOW]
    if static_one and whole and len(underflowing) * 2 < len(with_params):
        settings["loss_scale"] = "dynamic"
        names = ", ".join(e["name"] or "(model)" for e in whole[:4]) + (" ..." if len(whole) > 4 else "")
        notes.append(f"gradient underflow: the gradient of {names} is {FULL_UNDERFLOW:.0%}+ zero or subnormal in "
                     f"{half} and the loss is not scaled: that layer never learns. Use a dynamic loss scale "
                     "(amp.initialize(..., loss_scale='dynamic')).")
    elif static_one and with_params and len(underflowing) * 2 >= len(with_params):
        settings["loss_scale"] = "dynamic"
        worst = max(underflowing, key=lambda e: e["grad_underflow"])
        notes.append(f"gradient underflow: in {len(underflowing)} of {len(with_params)} layers with parameters, at "
                     f"least {UNDERFLOW_SHARE:.0%} of the gradient is zero or subnormal in {half} (worst: "
                     f"{worst['name']}, {worst['grad_underflow']:.0%}) and the loss is not scaled: use a dynamic "
                     "loss scale (amp.initialize(..., loss_scale='dynamic'))."
                     + (" At O3 the unscaled gradients are float16 again and keep few bits; O2's FP32 master "
                        "gradients keep them whole." if doc.get("opt_level") == "O3" else ""))
    bad_loss = next((s for s in steps if not s["loss_finite"]), None)
    if bad_loss is not None and forward is None:
        notes.append(f"the loss is not finite at step {bad_loss['step']} while every module's output was: the "
                     "problem is in the loss computation or the data (a log or division of 0, bad labels), not "
                     "in a module.")
    if not steps:
        notes.append("no optimizer step was recorded: the script never completed a step under an ampatch "
                     "session (amp.initialize, then scale_loss and optimizer.step).")
    if fault is not None and first is None:
        first = {"step": fault.step, "phase": "step", "module": fault.modules[0], "kind": "nonfinite weights"}
    return Diagnosis(steps=len(steps), half_dtype=half, first_nonfinite=first, modules=leaves + others,
                     keep_fp32=keep, settings=settings, notes=notes, step_fault=fault,
                     loss=[s["loss"] for s in steps], loss_scale=[s["loss_scale"] for s in steps],
                     skipped_steps=[s["step"] for s in steps if s["skipped"]])


def _parent(name: str) -> str | None:
    """The enclosing module's name ("a.b.c" -> "a.b", "a" -> "" the model), None for the model."""
    return None if name == "" else name.rpartition(".")[0]


def grow(keep: list[str] | tuple[str, ...], found: Diagnosis | None) -> str | None:
    """The module to add to `keep` when keeping it in FP32 did not make a run finite: the run's
    first non-finite module if new, else the parent of the last module kept; None after a step
    fault (no module to keep helps) or when nothing is left to add. The one growth rule of
    `diagnose`'s verification and `tune`'s repairs."""
    if found is not None and found.step_fault is not None:
        return None
    first = found.first_nonfinite if found is not None else None
    if first is not None and first["module"] not in keep:
        return first["module"]
    for name in reversed(keep):
        parent = _parent(name)
        if parent is not None and parent not in keep:
            return parent
    return None
