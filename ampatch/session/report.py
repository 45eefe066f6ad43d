"""`report()`: what a session did, as a typed snapshot that prints as a table and travels
as JSON (a run's ``AMPATCH_REPORT``, which `ampatch compare`, `run --report` and `tune` read
back with `Report.from_dict`, the one reading of it).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, reason
from ..machine.hardware import SessionDevice
from ..model.fp8 import EMULATED

__all__ = ["Report"]


def _seconds(value: float | None) -> str:
    return "not measured (AMPATCH_TIME_WRAPPERS=1)" if value is None else f"{value:.3f}s"


@dataclass
class Report:
    """A snapshot of a session's telemetry; `str()` is a table, `to_dict()` is JSON-ready."""

    opt_level: str
    half_dtype: str | None
    enabled: bool
    casts: dict[str, dict[str, int]]  # op -> {dtype: calls that converted an argument to it}; none: not listed
    cache: dict[str, int]
    steps: int
    skipped_steps: list[int]
    loss_scale: dict[str, float]
    loss_scale_history: dict[str, list[list[float]]]
    time_s: dict[str, float | None]  # "wrappers" is None unless AMPATCH_TIME_WRAPPERS=1
    step_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    # a long run's series are thinned (at most SERIES_POINTS each): losses[i] is the loss of
    # the (i * losses_every)-th scale_loss, step_times_s[i] the (i * step_times_every)-th step
    losses_every: int = 1
    step_times_every: int = 1
    peak_memory_bytes: int = 0
    device: SessionDevice | None = None  # hardware.check_half: the device, its half dtype, native there?
    keep_fp32: list[str] = field(default_factory=list)  # the modules kept in FP32 (keep_fp32, AMPATCH_KEEP_FP32)
    # what keeps the exact weights (config.values.MasterMode: "none", "fp32", "stochastic", "kahan"), and
    # the bytes per trained parameter (those the optimizers step) of its weight plus master or compensation
    master_weights: str = ""
    trained_params: int = 0
    bytes_per_param: float = 0.0
    optimizer_state_bytes: int = 0  # the optimizers' state tensors (Adam's moments, momentum buffers, ...)
    # what the state is kept in (config.values.StatePrecision: "float32", "bfloat16", "int8")
    optimizer_states: str = ""
    # int8: the share of the kept elements at the bottom of their block's range (values it could not hold)
    optimizer_state_underflow: float = 0.0
    # fp8=: the recipe ("" when off; "custom" for a torchao config), whether it was emulated (no FP8
    # tensor cores here: numerics only, not speed), and each Linear layer: name, kind, in_features,
    # out_features, converted, reason (model.fp8_choice.LayerChoice)
    fp8: str = ""
    fp8_emulated: bool = False
    fp8_layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def fp8_label(self) -> str:
        """How a table row or a notice names this run's FP8: "" without it, else the recipe,
        with "fp8 emulated: numerics only, not speed" where it was emulated."""
        if not self.fp8:
            return ""
        return f"fp8 {self.fp8}" + (f" ({EMULATED})" if self.fp8_emulated else "")

    @property
    def training_bytes_per_param(self) -> float | None:
        """Bytes held per trained parameter for training itself: the weight, its master or
        compensation, and the optimizer's state (None: no parameter was trained). What
        `ampatch compare`'s B/param column shows and `tune --objective memory` minimises."""
        if not self.trained_params:
            return None
        return self.bytes_per_param + self.optimizer_state_bytes / self.trained_params

    @property
    def state_bytes_per_param(self) -> float | None:
        """Bytes of the optimizers' state per trained parameter (kept state as it is kept)."""
        return self.optimizer_state_bytes / self.trained_params if self.trained_params else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: plain numbers, strings, lists and dicts (the device as its fields)."""
        out = dict(self.__dict__)
        out["device"] = self.device.to_dict() if self.device is not None else {}
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Report:
        """The report `to_dict` gave, read back (a child run's ``AMPATCH_REPORT`` JSON): the one
        reading of it. A field with a default may be missing (a report of an older ampatch);
        a missing required field, an unknown field or a value of the wrong type raises
        ValueError naming it, instead of a wrong figure later."""
        def fits(value: Any, hint: Any) -> bool:
            origin = typing.get_origin(hint)
            if origin in (typing.Union, types.UnionType):
                return any(fits(value, arg) for arg in typing.get_args(hint))
            if hint is Any:
                return True
            if hint is type(None):
                return value is None
            if hint is float:
                return isinstance(value, (int, float)) and not isinstance(value, bool)
            if hint is int:
                return isinstance(value, int) and not isinstance(value, bool)
            return isinstance(value, origin or hint)

        if not isinstance(data, dict):
            raise ConfigError(f"a report is a JSON object, not {type(data).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(f"unknown report field(s) {', '.join(map(repr, unknown))}: written by another ampatch?")
        missing = [name for name, f in fields.items() if name not in data
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ConfigError(f"the report lacks {', '.join(map(repr, missing))}")
        data = dict(data)
        device = data.pop("device", None)
        hints = typing.get_type_hints(cls)
        for name, value in data.items():
            if not fits(value, hints[name]):
                expected = hints[name].__name__ if isinstance(hints[name], type) else hints[name]
                raise ConfigError(f"report field {name!r} is a {type(value).__name__}, not {expected}")
        if device is not None and not isinstance(device, dict):
            raise ConfigError(f"report field 'device' is a {type(device).__name__}, not an object")
        try:
            data["device"] = SessionDevice.from_dict(device) if device else None
        except ValueError as exc:
            raise ConfigError(f"report field 'device': {reason(exc)}") from None
        return cls(**data)

    def _fp8_lines(self) -> list[str]:
        if not self.fp8:
            return []
        converted = sum(1 for layer in self.fp8_layers if layer["converted"])
        lines = [f"  {self.fp8_label}: {converted} of {len(self.fp8_layers)} Linear layers converted"]
        for layer in self.fp8_layers:
            lines.append(f"    {'fp8 ' if layer['converted'] else 'skip'} {layer['name']} ({layer['kind']} "
                         f"{layer['in_features']}->{layer['out_features']}): {layer['reason']}")
        return lines

    def __str__(self) -> str:
        lines = [f"ampatch report: opt_level={self.opt_level} half_dtype={self.half_dtype} "
                 f"enabled={self.enabled}",
                 *([f"  device: {self.device.to_dict()['summary']}"] if self.device is not None else []),
                 *([f"  kept in FP32: {', '.join(n or '(the whole model)' for n in self.keep_fp32)}"]
                   if self.keep_fp32 else []),
                 *([f"  master weights: {self.master_weights}, {self.bytes_per_param:.2f} bytes per trained "
                    f"parameter ({self.trained_params:,} parameters), "
                    f"{self.training_bytes_per_param:.2f} with the optimizer's state"] if self.trained_params else []),
                 *([f"  optimizer state: {self.optimizer_states or 'float32'}, "
                    f"{self.state_bytes_per_param:.2f} bytes per trained parameter"
                    + (f", {self.optimizer_state_underflow:.1%} of its int8 elements at the bottom of their block's "
                       "range" if self.optimizer_states == "int8" else "")]
                   if self.trained_params else []),
                 *self._fp8_lines(),
                 f"  steps {self.steps}, skipped {len(self.skipped_steps)}"
                 + (f" at {self.skipped_steps[:10]}" if self.skipped_steps else ""),
                 f"  cast cache: {self.cache['hits']} hits, {self.cache['misses']} misses",
                 f"  time in ampatch: wrappers {_seconds(self.time_s['wrappers'])}, "
                 f"scale_loss {_seconds(self.time_s['scale_loss'])}"]
        for name, scale in self.loss_scale.items():
            changes = len(self.loss_scale_history.get(name, [])) - 1
            lines.append(f"  {name}: scale {scale:g} ({changes} changes)")
        if self.casts:
            width = max(len(op) for op in self.casts)
            lines.append(f"  {'op'.ljust(width)}  casts")
            for op, per_dtype in sorted(self.casts.items(), key=lambda kv: -sum(kv[1].values())):
                detail = ", ".join(f"{d}: {n}" for d, n in sorted(per_dtype.items()))
                lines.append(f"  {op.ljust(width)}  {detail}")
        return "\n".join(lines)
