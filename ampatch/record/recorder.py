"""Per-module precision statistics of the first optimizer steps of a session.

A `Recorder` puts hooks on every module of the session's models and, for each call of a
module while it records:

- forward: the output's largest finite magnitude and its inf/NaN count, the inputs' inf/NaN
  count, and the local relative error against the module's FP32 shadow (`shadow.py`);
- backward: tensor hooks on the call's outputs and inputs count inf/NaN in the grads that
  reach it and that it sends on, in the order autograd produces them;
- per parameter, as produced (scaled, before unscaling): inf/NaN and the share of elements
  that are zero or subnormal in the half dtype;
- per parameter tensor and optimizer step: the share of its elements the step left unchanged
  (`stalls.StallCounter`: updates below the half dtype's resolution round away);
- with `fp8`, each layer run in FP8 against bfloat16 on its own inputs (`fp8_probe.Fp8Probe`).

It keeps numbers, never tensors. Each step also notes the first module to *finish* its
forward with a non-finite output from finite inputs (the innermost culprit) and the first
module whose grads towards its inputs or parameters turn non-finite while the grads at its
outputs were finite. After `steps` optimizer steps it removes its hooks, so the rest of the
run goes at full speed. `analysis.analyse` turns `result()` into the diagnosis.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from ..base.dtypes import short_name
from ..errors import ConfigError
from ..model.keep import labelled
from .fp8_probe import Fp8Probe
from .records import ModuleRecord, StepRecord
from .shadow import Masters, RandomState, is_quiet, run_shadow, upcast
from .stalls import StallCounter
from .stats import floating_tensors, magnitude, relative_error, underflow_fraction

logger = logging.getLogger("ampatch")

__all__ = ["Recorder", "module_names"]

SHADOWS_PER_STEP = 4  # shadow runs per module and step (a module called in a loop is measured a few times)


def module_names(models: Sequence[nn.Module]) -> list[tuple[str, nn.Module]]:
    """(name, module) for every module of `models`, named as `named_modules()` names them;
    with several models prefixed by the model's index ("1.head", the root "1")."""
    out, seen = [], set()
    for e in labelled(models):  # keep's labels: what diagnose recommends, keep_fp32 accepts
        if id(e.module) not in seen:
            seen.add(id(e.module))
            out.append((e.label, e.module))
    return out


class _Frames(threading.local):
    def __init__(self) -> None:
        # (module id, non-finite inputs, FP32 copy of (args, kwargs) or None, random state or None) per open call
        self.stack: list[tuple[int, int, Any, RandomState | None]] = []


class Recorder:
    """Hooks that measure `models` for the first `steps` optimizer steps (see the module
    docstring). `masters(param)` gives a half parameter's FP32 master (O2/O5) for the
    shadows; without one, the parameter's own values are upcast."""

    def __init__(self, models: Sequence[nn.Module], half_dtype: torch.dtype, steps: int,
                 masters: Masters | None = None, on_done: Callable[["Recorder"], None] | None = None,
                 shadows: bool = True, fp8: Fp8Probe | None = None) -> None:
        if steps < 1:
            raise ConfigError(f"steps must be at least 1, got {steps}.")
        self.half_dtype = half_dtype
        self.steps_wanted = steps
        self.masters = masters
        self.on_done = on_done
        self.shadows = shadows
        self.names = module_names(models)
        self.records = {name: ModuleRecord(name, type(m).__name__, not any(True for _ in m.children()))
                        for name, m in self.names}
        self.steps: list[StepRecord] = []
        self.active = False
        self._lock = threading.Lock()
        self._frames = _Frames()
        self._handles: list[Any] = []
        self._param_owner: dict[int, str] = {}
        self.stalls = StallCounter(self.names, masters)
        self.fp8 = fp8
        self._new_step()

    # ------------------------------------------------------------------ set-up
    def attach(self) -> None:
        for name, m in self.names:
            self._handles.append(m.register_forward_pre_hook(functools.partial(self._pre, name), with_kwargs=True))
            self._handles.append(m.register_forward_hook(functools.partial(self._post, name), with_kwargs=True))
            for p in m.parameters(recurse=False):
                if p.requires_grad and id(p) not in self._param_owner:
                    self._param_owner[id(p)] = name
                    self._handles.append(p.register_hook(functools.partial(self._param_grad, name)))
        if self.fp8 is not None:
            self.fp8.attach()
        self.active = True

    def detach(self) -> None:
        """Remove every hook (tensor hooks already on a live graph see `active` and do nothing)."""
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self.fp8 is not None:
            self.fp8.detach()

    def close(self) -> None:
        """The session ends: stop recording, and report what was recorded if not done yet."""
        was_active = self.active
        self.detach()
        if was_active and self.on_done is not None:
            self.on_done(self)

    def _new_step(self) -> None:
        self._events: list[tuple[str, str, int]] = []  # (module, "in"/"out", non-finite count), backward order
        self._forward_culprit: str | None = None
        self._forward_kind: str | None = None
        self._loss: float | None = None
        self._loss_finite = True
        self._scale = 1.0
        self._shadows: dict[str, int] = {}

    # ------------------------------------------------------------------ forward
    def _pre(self, name: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.active or is_quiet():
            return
        in_bad = magnitude(list(floating_tensors((args, kwargs))))[1]  # before the call: in-place ops
        # an FP32 copy of the inputs (and the random state) only for a call that will get a shadow
        if self.shadows and in_bad == 0 and self._shadows.get(name, 0) < SHADOWS_PER_STEP:
            device = next((t.device for t in module.parameters(recurse=True)), None)
            self._frames.stack.append((id(module), in_bad, upcast((args, kwargs)), RandomState.capture(device)))
        else:
            self._frames.stack.append((id(module), in_bad, None, None))

    def _post(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self.active or is_quiet():
            return
        stack = self._frames.stack
        while stack and stack[-1][0] != id(module):  # frames of calls that raised
            stack.pop()
        if not stack:
            return
        _, in_bad, inputs, rng = stack.pop()
        outs = list(floating_tensors(output))
        amax, bad = magnitude(outs)
        rel, failure = None, None
        if inputs is not None and outs:
            self._shadows[name] = self._shadows.get(name, 0) + 1
            try:
                shadow = run_shadow(module, inputs[0], inputs[1], rng, self.masters)
                rel = relative_error(outs, list(floating_tensors(shadow)))
            except Exception as exc:  # a module that cannot run in FP32: no error figure, never a failed run
                failure = f"{type(exc).__name__}: {exc}"
        with self._lock:
            r = self.records[name]
            r.calls += 1
            r.out_amax = max(r.out_amax, amax)
            r.out_nonfinite += bad
            r.in_nonfinite += in_bad
            if rel is not None:
                r.rel_errors.append(rel)
            if failure is not None:
                r.shadow_failures += 1
                r.shadow_error = r.shadow_error or failure[:200]
            if bad and not in_bad and self._forward_culprit is None:
                self._forward_culprit = name
                self._forward_kind = "overflow" if any(bool(torch.isinf(t).any()) for t in outs) else "nan"
        for t in outs:
            if t.requires_grad:
                t.register_hook(functools.partial(self._grad, name, "out"))
        for t in floating_tensors((args, kwargs)):
            if t.requires_grad:
                t.register_hook(functools.partial(self._grad, name, "in"))

    # ------------------------------------------------------------------ backward
    def _grad(self, name: str, side: str, grad: torch.Tensor) -> None:
        if not self.active or grad is None:
            return
        bad = magnitude([grad])[1]
        with self._lock:
            r = self.records[name]
            if side == "out":
                r.grad_out_nonfinite += bad
            else:
                r.grad_in_nonfinite += bad
            self._events.append((name, side, bad))

    def _param_grad(self, name: str, grad: torch.Tensor) -> None:
        if not self.active or grad is None:
            return
        bad = magnitude([grad])[1]
        under = underflow_fraction(grad, self.half_dtype)
        with self._lock:
            r = self.records[name]
            r.param_grad_nonfinite += bad
            r.grad_underflow = under if r.grad_underflow is None else max(r.grad_underflow, under)
            self._events.append((name, "in", bad))

    # ------------------------------------------------------------------ steps
    def on_loss(self, loss: torch.Tensor, scale: float) -> None:
        """The loss of a `scale_loss` block, and the scale it is multiplied by."""
        if not self.active:
            return
        value = float(loss.detach().float().mean())
        with self._lock:
            self._loss = value if self._loss is None else self._loss
            self._loss_finite = self._loss_finite and bool(torch.isfinite(loss.detach()).all())
            self._scale = scale
        self.stalls.before_step()  # the weights before this step's update (its first loss: before backward)

    def on_step(self, skipped: bool) -> None:
        """An optimizer step ended (skipped on overflow or not): close the step's record."""
        if not self.active:
            return
        stepped_bad = [] if skipped else self._nonfinite_params()
        self.stalls.after_step(skipped)
        if self.fp8 is not None:
            self.fp8.on_step()
        with self._lock:
            culprit = _backward_culprit(self._events)
            self.steps.append(StepRecord(
                step=len(self.steps), loss=self._loss, loss_finite=self._loss_finite, loss_scale=self._scale,
                skipped=skipped, forward_culprit=self._forward_culprit, forward_kind=self._forward_kind,
                backward_culprit=culprit,
                backward_nonfinite=any(bad for _, _, bad in self._events), stepped_nonfinite=stepped_bad))
            self._new_step()
            done = len(self.steps) >= self.steps_wanted
        if done:
            self.detach()
            if self.on_done is not None:
                self.on_done(self)

    def _nonfinite_params(self) -> list[str]:
        """The modules whose own parameters hold inf/NaN (after an optimizer step): a step
        that turns finite weights non-finite is a fault of the step, not of a module."""
        with torch.no_grad():
            return [name for name, m in self.names
                    if any(not bool(torch.isfinite(p).all()) for p in m.parameters(recurse=False))]

    def result(self) -> dict[str, Any]:
        """What was recorded, as plain JSON-ready data (the "recorded" part of a `Recording`)."""
        with self._lock:
            return {
                "half_dtype": short_name(self.half_dtype),
                "steps_wanted": self.steps_wanted,
                "steps": [asdict(s) for s in self.steps],
                "modules": [asdict(self.records[name]) for name, _ in self.names],
                "params": [asdict(p) for p in self.stalls.records],
                "fp8": [asdict(f) for f in self.fp8.result()] if self.fp8 is not None else [],
            }


def _backward_culprit(events: list[tuple[str, str, int]]) -> str | None:
    """The first module, in backward order, whose grads towards its inputs (or parameters)
    are non-finite while every grad that reached its outputs so far was finite."""
    out_seen: dict[str, bool] = {}  # module -> a non-finite grad reached its outputs
    for name, side, bad in events:
        if side == "out":
            out_seen[name] = out_seen.get(name, False) or bad > 0
        elif bad and name in out_seen and not out_seen[name]:
            return name
    return None
