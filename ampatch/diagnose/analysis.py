"""From a recording to a diagnosis: where half precision hurts, and what to change.

`diagnosis(recording)` reads what a diagnosed run wrote (a `ampatch.record.records.Recording`,
or its JSON) into a typed `Diagnosis` (`result.py`); `analyse` is its JSON:

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
  settings that are not modules (a dynamic loss scale against gradient underflow: when most
  layers underflow, or when one layer's gradient underflows whole, so that it never learns;
  FP32 master weights against stalled updates, `stalls.py`; never for bfloat16, whose range
  is FP32's: its zero gradients are O0's too), and notes in words;
- `step_fault`: an optimizer step that turned finite weights inf/NaN from finite gradients (a
  float16-rounded Adam eps at O3): not a module's precision, so no module is recommended for
  what follows from it (the next forward's inf/NaN, a loss gone non-finite); the recommendation
  is FP32 master weights, as for an Adam eps the session found float16 rounds to 0 (the
  optimizer then steps FP32 copies: its eps and its updates keep their value);
- `fp8`: with layers run in FP8, each against bfloat16, and those FP8 hurts (`fp8.judge`),
  which the recommendation leaves out of FP8.
"""
from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from ..base.dtypes import from_short_name, is_low
from ..record.records import ModuleRecord, Recording, StepRecord
from ..record.stats import headroom
from . import fp8 as fp8_layers
from . import stalls
from .result import Diagnosis, FirstNonfinite, ModuleEntry, Recommendation, Settings, StepFault

__all__ = ["analyse", "diagnosis", "grow", "error_floor", "blame_line", "OUTLIER_FACTOR", "UNDERFLOW_SHARE",
           "FULL_UNDERFLOW"]

OUTLIER_FACTOR = 10.0   # a leaf's error this many times the median leaf's stands out
EPS_MULTIPLE = 32.0     # ... and it must exceed this many machine epsilons of the half dtype
UNDERFLOW_SHARE = 0.5   # a parameter's grad with this share zero/subnormal has underflowed
FULL_UNDERFLOW = 0.99   # ... with this share, the layer never learns: a finding even for one layer


def _half(name: str | None) -> torch.dtype | None:
    """The half dtype a recording names (None when it names none, or FP32)."""
    dtype = from_short_name(name)
    return dtype if dtype is not None and is_low(dtype) else None


def error_floor(half: str | None) -> float:
    """The local relative error below which a module is never blamed: EPS_MULTIPLE machine
    epsilons of the half dtype (float16: 0.031, bfloat16: 0.25)."""
    dtype = _half(half) or torch.bfloat16
    return EPS_MULTIPLE * torch.finfo(dtype).eps


def _entry(m: ModuleRecord, half: str | None, weights: stalls.ModuleStall | None) -> ModuleEntry:
    err = max(m.rel_errors) if m.rel_errors else None
    dtype = _half(half)
    finite = err is not None and err != float("inf")
    return ModuleEntry(
        name=m.name, type=m.type, leaf=m.leaf, calls=m.calls, out_amax=m.out_amax,
        headroom=headroom(m.out_amax, dtype) if dtype is not None else None,
        out_nonfinite=m.out_nonfinite,
        grad_nonfinite=m.grad_in_nonfinite + m.grad_out_nonfinite + m.param_grad_nonfinite,
        grad_underflow=m.grad_underflow,
        # inf (the half output was not finite, its FP32 shadow was) is written as null, with the flag
        rel_error=err if finite else None, rel_error_inf=err is not None and not finite,
        shadow_error=m.shadow_error,
        unchanged=weights.unchanged if weights else None, weights=weights.weights if weights else 0,
        held_in=weights.held_in if weights else None)


def _is_within(name: str, others: Sequence[str]) -> bool:
    """`name` is one of `others` or a submodule of one ("" is the root of a single model)."""
    return any(o == name or o == "" or name.startswith(o + ".") for o in others)


def _persistent_backward(steps: list[StepRecord]) -> tuple[StepRecord | None, list[str]]:
    """The backward culprit of the streak of non-finite backward passes that lasts to the last
    step (None if a later step's backward was clean), and notes on streaks that ended while the
    loss scale backed off. Steps whose forward already went non-finite (a non-finite loss, a
    forward culprit) say nothing about the backward: they neither start nor end a streak."""
    notes = []
    streak_start = None
    for i, s in enumerate(steps):
        if not s.loss_finite or s.forward_culprit is not None:
            continue
        if s.backward_nonfinite:
            streak_start = i if streak_start is None else streak_start
        elif streak_start is not None:
            first = steps[streak_start]
            if s.loss_scale < first.loss_scale:
                notes.append(f"non-finite gradients from step {first.step} went away once the loss scale backed "
                             f"off from {first.loss_scale:g} to {s.loss_scale:g}: the dynamic loss scaler "
                             "doing its job, not a module to keep in FP32.")
            streak_start = None
    if streak_start is None:
        return None, notes
    return next((s for s in steps[streak_start:] if s.backward_culprit), None), notes


def _step_fault(steps: list[StepRecord]) -> StepFault | None:
    """The first step that left some module's weights inf/NaN although its loss and every
    gradient were finite and it was not skipped."""
    for s in steps:
        bad = s.stepped_nonfinite or []
        if bad and not s.skipped and s.loss_finite and not s.backward_nonfinite:
            names = ", ".join(n or "(model)" for n in bad[:4]) + (" ..." if len(bad) > 4 else "")
            return StepFault(s.step, tuple(bad), (
                f"step fault: the optimizer step at step {s.step} made the weights of {names} inf/NaN from finite "
                "gradients: the optimizer's own arithmetic in the half dtype (e.g. an Adam eps that float16 "
                "rounds to 0), not a module's precision; keeping modules in FP32 cannot help: use FP32 "
                "master weights (O2), bfloat16, or a larger eps."))
    return None


def _first_nonfinite(steps: list[StepRecord], fault: StepFault | None,
                     notes: list[str]) -> tuple[FirstNonfinite | None, list[str]]:
    """The first non-finite module and the modules it makes the recommendation keep."""
    before = [s for s in steps if s.step <= fault.step] if fault is not None else steps
    forward = next((s for s in before if s.forward_culprit is not None), None)
    backward, scaler_notes = _persistent_backward(before)
    notes += scaler_notes
    first = None
    if forward is not None:
        first = FirstNonfinite(forward.step, "forward", forward.forward_culprit or "",
                               forward.forward_kind or "nonfinite")
    if backward is not None and (forward is None or backward.step < forward.step):
        first = FirstNonfinite(backward.step, "backward", backward.backward_culprit or "", "nonfinite gradient")
    keep: list[str] = []
    for name in (forward.forward_culprit if forward else None, backward.backward_culprit if backward else None):
        if name is not None and not _is_within(name, keep):
            keep.append(name)
    if fault is not None and first is None:
        first = FirstNonfinite(fault.step, "step", fault.modules[0], "nonfinite weights")
    if forward is None:  # a loss gone non-finite after a faulty step is that step's doing, not the data's
        bad_loss = next((s for s in before if not s.loss_finite and not s.stepped_nonfinite), None)
        if bad_loss is not None:
            notes.append(f"the loss is not finite at step {bad_loss.step} while every module's output was: the "
                         "problem is in the loss computation or the data (a log or division of 0, bad labels), not "
                         "in a module.")
    return first, keep


def blame_line(leaves: Sequence[ModuleEntry], half: str | None) -> float:
    """The local error above which a leaf is named: `OUTLIER_FACTOR` times the median leaf's,
    and at least `error_floor` (what `diagnose --plot` draws as its line)."""
    finite_errors = [e.rel_error for e in leaves if e.rel_error is not None]
    typical = statistics.median(finite_errors) if finite_errors else 0.0
    return max(error_floor(half), OUTLIER_FACTOR * typical)


def _outliers(leaves: list[ModuleEntry], half: str | None, keep: list[str], notes: list[str]) -> None:
    """Leaves whose local error stands far above the typical leaf's join `keep`."""
    finite_errors = [e.rel_error for e in leaves if e.rel_error is not None]
    if not finite_errors:
        return
    typical = statistics.median(finite_errors)
    bar = blame_line(leaves, half)
    for e in leaves:
        if e.rel_error is not None and e.rel_error > bar and not _is_within(e.name, keep):
            keep.append(e.name)
            than = (f"{e.rel_error / typical:.0f}x the typical module's {typical:.2g}" if typical > 0 else
                    f"above {bar:.2g} ({EPS_MULTIPLE:g} machine epsilons of {half}; the typical module's is 0)")
            notes.append(f"{e.name or '(model)'} ({e.type}): local error {e.rel_error:.3g} against its FP32 shadow, "
                         f"{than}.")


def _underflow(leaves: list[ModuleEntry], steps: list[StepRecord], half: str | None, level: str | None,
               notes: list[str]) -> str | None:
    """"dynamic" when the gradients underflow without a loss scale (see the module docstring).
    Never for a half dtype whose normal range reaches as low as FP32's (bfloat16): its zero or
    subnormal gradients are FP32's too (a saturated softmax, dead units), so O0 has them and no
    loss scale brings them back; a loss scale recovers only what a narrower range loses."""
    dtype = _half(half)
    if dtype is None or torch.finfo(dtype).tiny <= torch.finfo(torch.float32).tiny:
        return None
    static_one = bool(steps) and all(s.loss_scale == 1.0 for s in steps)
    with_params = [(e, e.grad_underflow) for e in leaves if e.grad_underflow is not None]  # (layer, share)
    underflowing = [e for e, share in with_params if share >= UNDERFLOW_SHARE]
    whole = [e for e, share in with_params if share >= FULL_UNDERFLOW]
    if static_one and whole and len(underflowing) * 2 < len(with_params):
        names = ", ".join(e.name or "(model)" for e in whole[:4]) + (" ..." if len(whole) > 4 else "")
        notes.append(f"gradient underflow: the gradient of {names} is {FULL_UNDERFLOW:.0%}+ zero or subnormal in "
                     f"{half} and the loss is not scaled: that layer never learns. Use a dynamic loss scale "
                     "(amp.initialize(..., loss_scale='dynamic')).")
        return "dynamic"
    if static_one and with_params and len(underflowing) * 2 >= len(with_params):
        worst = max(underflowing, key=lambda e: e.grad_underflow or 0.0)
        notes.append(f"gradient underflow: in {len(underflowing)} of {len(with_params)} layers with parameters, at "
                     f"least {UNDERFLOW_SHARE:.0%} of the gradient is zero or subnormal in {half} (worst: "
                     f"{worst.name}, {worst.grad_underflow:.0%}) and the loss is not scaled: use a dynamic "
                     "loss scale (amp.initialize(..., loss_scale='dynamic'))."
                     + (" At O3 the unscaled gradients are float16 again and keep few bits; O2's FP32 master "
                        "gradients keep them whole." if level == "O3" else ""))
        return "dynamic"
    return None


def analyse(doc: dict[str, Any] | Recording) -> dict[str, Any]:
    """The diagnosis of one recorded run (see the module docstring), as JSON."""
    return diagnosis(doc).to_dict()


def diagnosis(doc: dict[str, Any] | Recording) -> Diagnosis:
    """The diagnosis of one recorded run (see the module docstring); raises
    `record.records.RecordingError` for a document this ampatch does not read."""
    rec = doc if isinstance(doc, Recording) else Recording.from_dict(doc)
    half, steps = rec.half_dtype, rec.steps
    weights = stalls.by_module(rec.params)
    entries = [_entry(m, half, weights.get(m.name)) for m in rec.modules]
    leaves = sorted((e for e in entries if e.leaf), key=lambda e: e.rank, reverse=True)
    others = sorted((e for e in entries if not e.leaf), key=lambda e: e.rank, reverse=True)
    notes: list[str] = list(rec.notes)

    fault = _step_fault(steps)
    if fault is not None:  # what follows from a faulty step is its consequence, not a module's precision
        notes.append(fault.note)
    first, keep = _first_nonfinite(steps, fault, notes)
    _outliers(leaves, half, keep, notes)
    keep = [k for k in keep if not _is_within(k, [o for o in keep if o != k])]  # the smallest set
    fp8, fp8_notes = fp8_layers.judge(fp8_layers.entries(rec.fp8))
    hurt = {e.name for e in fp8 if e.hurts}  # their gradients vanish in FP8's casts: no loss scale brings them back
    loss_scale = _underflow([e for e in leaves if e.name not in hurt], steps, half, rec.opt_level, notes)
    stall = stalls.stall(rec.params, rec.master_weights)
    if stall is not None:
        notes.append(stalls.note(stall, rec.opt_level))
    if not steps:
        notes.append("no optimizer step was recorded: the script never completed a step under an ampatch "
                     "session (amp.initialize, then scale_loss and optimizer.step).")
    # the optimizer's own step in the half dtype (a step fault, an Adam eps float16 rounds to 0) is kept finite by
    # FP32 masters, as stalled updates are kept by them: the recommendation follows those findings
    own_step = rec.master_weights == "none" and (fault is not None or bool(rec.eps_lost))
    masters = (stall is not None and stall.finding) or own_step
    settings = Settings(loss_scale=loss_scale, master_weights=True if masters else None)
    notes += fp8_notes
    exclude = tuple(e.name for e in fp8 if e.hurts)
    left = tuple(e.name for e in fp8 if not e.hurts) if exclude else None
    return Diagnosis(steps=len(steps), half_dtype=half, first_nonfinite=first, modules=tuple(leaves + others),
                     recommendation=Recommendation(tuple(keep), settings, tuple(notes), exclude, left),
                     step_fault=fault, fp8=tuple(fp8),
                     stall=stall, loss=tuple(s.loss for s in steps), loss_scale=tuple(s.loss_scale for s in steps),
                     skipped_steps=tuple(s.step for s in steps if s.skipped), opt_level=rec.opt_level,
                     master_weights=rec.master_weights)


def _parent(name: str) -> str | None:
    """The enclosing module's name ("a.b.c" -> "a.b", "a" -> "" the model), None for the model."""
    return None if name == "" else name.rpartition(".")[0]


def grow(keep: Sequence[str], found: Diagnosis | None) -> str | None:
    """The module to add to `keep` when keeping it in FP32 did not make a run finite: the run's
    first non-finite module if new, else the parent of the last module kept; None after a step
    fault (no module to keep helps) or when nothing is left to add. The one growth rule of
    `diagnose`'s verification and `tune`'s repairs."""
    if found is not None and found.step_fault is not None:
        return None
    first = found.first_nonfinite if found is not None else None
    if first is not None and first.module not in keep:
        return first.module
    for name in reversed(keep):
        parent = _parent(name)
        if parent is not None and parent not in keep:
            return parent
    return None
