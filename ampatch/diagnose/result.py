"""A diagnosis as typed data, and its JSON (`Diagnosis.to_dict`, the keys ``ampatch diagnose
--json`` writes: ``first_nonfinite``, ``modules``, ``recommendation``, ``verification``, ...).

- `ModuleEntry`: one module's figures (headroom, inf/NaN, underflow, local error, unchanged weights);
- `FirstNonfinite`, `StepFault`, `Stall`: the findings;
- `Settings` and `Recommendation`: what to change (modules to keep in FP32, layers to leave out
  of FP8, settings, why); the FP8 layers' entries are `fp8.Fp8Entry`;
- `Figures` and `Verification`: the reruns that check the recommendation against O0;
- `Diagnosis`: all of it for one diagnosed run.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from .fp8 import Fp8Entry

__all__ = ["ModuleEntry", "FirstNonfinite", "StepFault", "StalledModule", "Stall", "Settings", "Recommendation",
           "Figures", "Verification", "Diagnosis"]


@dataclass(frozen=True)
class ModuleEntry:
    """One module over the recorded steps (see `render` for what each figure means)."""

    name: str
    type: str
    leaf: bool
    calls: int
    out_amax: float
    headroom: float | None          # times its largest output fits under the half dtype's largest number
    out_nonfinite: int
    grad_nonfinite: int
    grad_underflow: float | None    # largest share of a parameter's grad that is zero/subnormal in half
    rel_error: float | None         # local error against its FP32 shadow, worst call (None: inf or not measured)
    rel_error_inf: bool
    shadow_error: str | None
    unchanged: float | None = None  # share of its own weights each of the last steps left unchanged (mean)
    weights: int = 0                # elements of its own parameters
    held_in: str | None = None      # the dtype that holds them (its masters' where there are)

    @property
    def rank(self) -> float:
        """The ranking key: local error, inf first, unmeasured last."""
        if self.rel_error_inf:
            return math.inf
        return -1.0 if self.rel_error is None else self.rel_error

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class FirstNonfinite:
    """The first module to produce inf/NaN (`phase`: "forward", "backward" or "step")."""

    step: int
    phase: str
    module: str
    kind: str


@dataclass(frozen=True)
class StepFault:
    """An optimizer step that made finite weights inf/NaN from finite gradients."""

    step: int
    modules: tuple[str, ...]
    note: str


@dataclass(frozen=True)
class StalledModule:
    name: str
    unchanged: float   # share of its weights each of the last steps left unchanged (mean)


@dataclass(frozen=True)
class Stall:
    """Stalled updates: weights that optimizer steps leave unchanged because each update is below
    the half dtype's resolution (pure-half weights without FP32 masters)."""

    modules: tuple[StalledModule, ...]   # the stalled modules, most stalled first
    unchanged: float                     # share of all the model's weights each step left unchanged (mean)
    steps: int                           # the recorded steps that mean is over (the later half)
    held_in: str                         # the half dtype the weights are held in
    finding: bool                        # enough of the model stalls to recommend masters

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Settings:
    """Settings a recommendation changes besides modules (None: left as they are)."""

    loss_scale: str | None = None         # "dynamic": against gradient underflow
    master_weights: bool | None = None    # True: FP32 masters, against stalled updates

    def __bool__(self) -> bool:
        return bool(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Recommendation:
    """What to change: modules to keep in FP32, settings, and the layers to leave out of FP8
    (`fp8_exclude`; `fp8_modules`: the layers then left in FP8, none: fp8 off; None: no change)."""

    keep_fp32: tuple[str, ...] = ()
    settings: Settings = Settings()
    notes: tuple[str, ...] = ()
    fp8_exclude: tuple[str, ...] = ()
    fp8_modules: tuple[str, ...] | None = None

    def __bool__(self) -> bool:
        return bool(self.keep_fp32) or bool(self.settings) or bool(self.fp8_exclude)

    def to_dict(self) -> dict[str, Any]:
        return {"keep_fp32": list(self.keep_fp32), "settings": self.settings.to_dict(), "notes": list(self.notes),
                "fp8_exclude": list(self.fp8_exclude),
                "fp8_modules": list(self.fp8_modules) if self.fp8_modules is not None else None}


@dataclass(frozen=True)
class Figures:
    """One verification run against O0: finite, final loss, deviation from O0's curve and the
    share of O0's progress it makes (`ampatch.runs.deviation`); `follows_O0`: it trains like
    FP32 by tune's rule (`ampatch.runs.verdict`), `verdict` saying why; None when not judged:
    O0 itself (`verdict` empty), or runs that cannot tell (O0 did not learn, too noisy)."""

    keep_fp32: tuple[str, ...]
    settings: Settings
    level: str | None
    finite: bool
    final_loss: float | None
    max_dev_vs_O0: float | None
    learned_vs_O0: float | None
    follows_O0: bool | None
    skipped_steps: int
    steps: int
    error: str | None
    fp8_exclude: tuple[str, ...] = ()   # the layers it left out of FP8
    verdict: str = ""                   # the rule's reason (runs.verdict.Verdict.reason); "" for O0

    @property
    def fixed(self) -> bool:
        """The run is finite and, where judged, follows O0."""
        return self.finite and self.follows_O0 is not False

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "keep_fp32": list(self.keep_fp32), "settings": self.settings.to_dict(),
                "fp8_exclude": list(self.fp8_exclude)}


@dataclass(frozen=True)
class Verification:
    """The reruns: the recommendation's last try (`verified`), the run without it, O0's, every try."""

    verified: Figures
    without: Figures
    O0: Figures
    tries: tuple[Figures, ...]
    gave_up: bool
    o0_progress: float | None = None   # how far O0's loss falls over the run (None: not beyond its noise)

    def to_dict(self) -> dict[str, Any]:
        return {**self.verified.to_dict(), "without": self.without.to_dict(), "O0": self.O0.to_dict(),
                "tries": [t.to_dict() for t in self.tries], "gave_up": self.gave_up, "o0_progress": self.o0_progress}


@dataclass(frozen=True)
class Diagnosis:
    """One recorded run, diagnosed; with the command's verification once it ran."""

    steps: int
    half_dtype: str | None
    first_nonfinite: FirstNonfinite | None
    modules: tuple[ModuleEntry, ...]     # leaves ranked by local error, then the others
    recommendation: Recommendation
    step_fault: StepFault | None = None
    stall: Stall | None = None
    loss: tuple[float | None, ...] = ()
    loss_scale: tuple[float, ...] = ()
    skipped_steps: tuple[int, ...] = ()
    opt_level: str | None = None
    master_weights: str = "none"         # the run's `config.values.MasterMode` value
    kept_already: tuple[str, ...] = ()
    crashed: str | None = None
    verification: Verification | None = None
    fp8: tuple[Fp8Entry, ...] = ()       # the layers run in FP8, each against bfloat16 (none without fp8)

    def with_notes(self, *notes: str) -> Diagnosis:
        rec = self.recommendation
        return replace(self, recommendation=replace(rec, notes=(*rec.notes, *notes)))

    def to_dict(self) -> dict[str, Any]:
        """The JSON ``ampatch diagnose --json`` writes."""
        return {"steps": self.steps, "half_dtype": self.half_dtype, "opt_level": self.opt_level,
                "first_nonfinite": asdict(self.first_nonfinite) if self.first_nonfinite else None,
                "modules": [m.to_dict() for m in self.modules],
                "recommendation": self.recommendation.to_dict(),
                "step_fault": asdict(self.step_fault) if self.step_fault else None,
                "stall": self.stall.to_dict() if self.stall else None,
                "loss": list(self.loss), "loss_scale": list(self.loss_scale), "skipped_steps": list(self.skipped_steps),
                "master_weights": self.master_weights, "kept_already": list(self.kept_already),
                "crashed": self.crashed, "verification": self.verification.to_dict() if self.verification else None,
                "fp8": [e.to_dict() for e in self.fp8]}
