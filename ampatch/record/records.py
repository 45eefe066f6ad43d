"""What a recording holds, and the JSON it travels in from the diagnosed run to the command.

- `ModuleRecord`: one module over the recorded steps (magnitudes, inf/NaN, underflow, local error);
- `StepRecord`: one optimizer step (loss, scale, skipped, the first non-finite module);
- `ParamRecord`: one parameter tensor: per step, the share of its elements the optimizer step
  left unchanged (`stalls.StallCounter`);
- `Fp8LayerRecord`: one layer run in FP8: its error against bfloat16 on its own inputs, and what
  the recipe's casts saturate and flush to zero (`fp8_probe.Fp8Probe`);
- `Recording`: the whole document (`FORMAT`): the session's set-up and the records.

The recorder fills the records while the run trains; ``ampatch diagnose`` reads the document
back with `Recording.from_dict` and never by key.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from ampatch.errors import RecordingError

__all__ = ["FORMAT", "ModuleRecord", "StepRecord", "ParamRecord", "Fp8LayerRecord", "Recording", "RecordingError"]

FORMAT = 3   # the version of the JSON written (2: per-parameter stall shares; 3: FP8 layers)


def _build(cls: type, data: Any, what: str) -> Any:
    """`cls(**data)` over the fields `cls` has; a missing field is a `RecordingError`."""
    if not isinstance(data, dict):
        raise RecordingError(f"{what}: expected an object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    try:
        return cls(**{k: v for k, v in data.items() if k in names})
    except TypeError as exc:
        raise RecordingError(f"{what}: {exc}") from None


@dataclass
class ModuleRecord:
    """What was measured of one module over the recorded steps."""

    name: str
    type: str
    leaf: bool
    calls: int = 0
    out_amax: float = 0.0
    out_nonfinite: int = 0
    in_nonfinite: int = 0
    grad_out_nonfinite: int = 0   # in the grads reaching its outputs
    grad_in_nonfinite: int = 0    # in the grads it sends towards its inputs
    param_grad_nonfinite: int = 0
    grad_underflow: float | None = None  # largest share over its own params' grads
    rel_errors: list[float] = field(default_factory=list)  # per shadowed call, finite or inf
    shadow_failures: int = 0
    shadow_error: str | None = None


@dataclass
class StepRecord:
    """One optimizer step while recording."""

    step: int
    loss: float | None
    loss_finite: bool
    loss_scale: float
    skipped: bool
    forward_culprit: str | None = None
    forward_kind: str | None = None  # "overflow" (inf in the output) or "nan"
    backward_culprit: str | None = None
    backward_nonfinite: bool = False
    stepped_nonfinite: list[str] = field(default_factory=list)  # modules whose own params the step left inf/NaN


@dataclass
class ParamRecord:
    """One parameter tensor: the share of its elements each recorded optimizer step left
    unchanged, among those with a non-zero gradient (None: the step was skipped, or no element
    had a gradient). `dtype` is that of the tensor that holds the weight: the FP32 master
    where there is one, else the parameter itself."""

    name: str        # "fc1.weight"
    module: str      # "fc1": the module whose own parameter it is
    dtype: str
    numel: int
    unchanged: list[float | None] = field(default_factory=list)


@dataclass
class Fp8LayerRecord:
    """One layer run in FP8 over the recorded steps, each measured call against the same GEMMs
    in bfloat16 on the same input, weights and output gradient (`fp8_error.layer_fp8_error`):
    the relative error of the output and of the weight gradient per call, and per FP8 cast
    the recipe makes ("input@output", "grad_output@grad_weight", ...: torchao's six; a cast
    the recipe keeps in high precision is absent) its FP8 dtype and, summed over the calls,
    the values cast (`n`) and those that saturate, flush to zero (non-zero values that become
    0) or land among FP8's subnormals."""

    name: str
    kind: str            # "Linear" or "Conv1D"
    recipe: str          # torchao's recipe name, "custom" for a config given whole
    emulated: bool       # torchao emulated FP8 (no FP8 tensor cores): numerics only, not speed
    calls: int = 0
    out_rel_err: list[float] = field(default_factory=list)
    wgrad_rel_err: list[float] = field(default_factory=list)
    casts: dict[str, dict[str, Any]] = field(default_factory=dict)
    failure: str | None = None

    def add(self, found: dict[str, Any]) -> None:
        """One call's `layer_fp8_error` result."""
        self.calls += 1
        self.out_rel_err.append(float(found["out_rel_err"]))
        self.wgrad_rel_err.append(float(found["wgrad_rel_err"]))
        for label, cast in found["per_cast"].items():
            if "n" not in cast:  # kept in high precision by the recipe
                continue
            total = self.casts.setdefault(label, {"dtype": cast["dtype"], "n": 0, "saturated": 0, "underflow": 0,
                                                  "subnormal": 0})
            for key in ("n", "saturated", "underflow", "subnormal"):
                total[key] += int(cast[key])


@dataclass(frozen=True)
class Recording:
    """The document a diagnosed run writes: how its session was set up, and what it recorded."""

    opt_level: str | None
    half_dtype: str | None
    loss_scale: float | str | None
    master_weights: str              # `config.values.MasterMode` value: "none", "fp32", "stochastic", "kahan"
    notes: list[str]
    keep_fp32: list[str]
    complete: bool                   # every step it was asked for was recorded
    steps_wanted: int
    steps: list[StepRecord]
    modules: list[ModuleRecord]
    params: list[ParamRecord]
    fp8: list[Fp8LayerRecord] = field(default_factory=list)  # the layers run in FP8 (none without fp8)
    eps_lost: list[str] = field(default_factory=list)  # the optimizer groups whose Adam eps float16 rounds to 0

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "opt_level": self.opt_level, "half_dtype": self.half_dtype,
                "loss_scale": self.loss_scale, "master_weights": self.master_weights, "notes": list(self.notes),
                "eps_lost": list(self.eps_lost),
                "keep_fp32": list(self.keep_fp32), "complete": self.complete,
                "recorded": {"half_dtype": self.half_dtype, "steps_wanted": self.steps_wanted,
                             "steps": [asdict(s) for s in self.steps], "modules": [asdict(m) for m in self.modules],
                             "params": [asdict(p) for p in self.params], "fp8": [asdict(f) for f in self.fp8]}}

    @classmethod
    def from_dict(cls, doc: Any) -> Recording:
        """The document as `to_dict` wrote it; a `RecordingError` names what does not fit."""
        if not isinstance(doc, dict):
            raise RecordingError(f"a recording is a JSON object, got {type(doc).__name__}")
        if doc.get("format") != FORMAT:
            raise RecordingError(f"the run wrote a recording of format {doc.get('format')!r}; this ampatch reads "
                                 f"{FORMAT}")
        raw = doc.get("recorded")
        if not isinstance(raw, dict):
            raise RecordingError("the recording has no 'recorded' object")
        return cls(opt_level=doc.get("opt_level"), half_dtype=doc.get("half_dtype") or raw.get("half_dtype"),
                   loss_scale=doc.get("loss_scale"), master_weights=doc.get("master_weights") or "none",
                   notes=list(doc.get("notes") or []), keep_fp32=list(doc.get("keep_fp32") or []),
                   complete=bool(doc.get("complete")), steps_wanted=int(raw.get("steps_wanted") or 0),
                   steps=[_build(StepRecord, s, "a recorded step") for s in raw.get("steps") or []],
                   modules=[_build(ModuleRecord, m, "a recorded module") for m in raw.get("modules") or []],
                   params=[_build(ParamRecord, p, "a recorded parameter") for p in raw.get("params") or []],
                   fp8=[_build(Fp8LayerRecord, f, "a recorded FP8 layer") for f in raw.get("fp8") or []],
                   eps_lost=[str(x) for x in doc.get("eps_lost") or []])
