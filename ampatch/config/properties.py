"""`initialize`'s `Options` checked as a whole against the level, the device and the
environment: `resolve` gives the session's `Properties`.

Property values mean what they meant in Apex (`frontend.py`'s `Properties`); the overrides
Apex refused raise `OverrideError` (a warning with `hard_override`). Settings from outside
(`env.Overrides`: ``AMPATCH_OPT_LEVEL`` and the rest, or a policy file through
``AMPATCH_POLICY``) beat the script by one rule, written once in `_outside_wins`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..base.dtypes import LOW, short_name
from . import levels
from .env import Overrides
from .options import NO_CAST, Options, OverrideError, warn_or_err
from .settings import SETTINGS
from .values import DYNAMIC, MasterMode

__all__ = ["Properties", "resolve", "OverrideError", "warn_or_err", "NO_CAST", "OUTSIDE"]

OUTSIDE = ("opt_level", "half_dtype", "loss_scale", "master_weights")  # what the environment may force


@dataclass(frozen=True)
class Properties:
    """The resolved configuration of a session (Apex's `amp` properties plus `half_dtype`)."""

    enabled: bool
    opt_level: str
    half_dtype: torch.dtype
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | str | None  # None at O1/O4; "stochastic"/"kahan": see MasterMode
    loss_scale: float | str
    cast_model_outputs: torch.dtype | None = None

    @property
    def casts_model(self) -> bool:
        """True when the model itself is converted to a half type (O2, O3, O5)."""
        return self.cast_model_type is not None and self.cast_model_type != torch.float32

    @property
    def patches_torch(self) -> bool:
        """True when this session patches torch's functions (O1, O4; enabled)."""
        return self.enabled and self.patch_torch_functions

    @property
    def master_mode(self) -> MasterMode:
        """What keeps the exact weights of half parameters: FP32 copies (`master_weights=True`),
        a low-memory mode, or none (O0/O1/O4: the FP32 model is its own master; O3)."""
        if self.master_weights is True:
            return MasterMode.FP32
        return MasterMode(self.master_weights) if isinstance(self.master_weights, str) else MasterMode.NONE

    @property
    def half_name(self) -> str | None:
        """The half dtype's name, None at O0 (`levels.half_name`)."""
        return levels.half_name(self.opt_level, self.half_dtype)

    def __str__(self) -> str:
        fields = (f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return "Properties(" + ", ".join(fields) + ")"


def resolve(options: Options, device: torch.device | None = None, overrides: Overrides = Overrides(),
            hard_override: bool | None = None) -> tuple[Properties, list[str]]:
    """The session's `Properties` for `options` on `device`, and the notes to log about what
    the environment changed. `hard_override`: Apex's flag (None: `SETTINGS.hard_override`).

    Without a forced level, an override Apex refused raises `OverrideError`. A forced level
    (from outside) wins instead, and each of the script's keywords that conflicts with it is
    dropped, with a note."""
    notes: list[str] = []
    hard = SETTINGS.hard_override if hard_override is None else hard_override
    forced = overrides.opt_level is not None
    if forced and levels.half_dtype_conflict(overrides.opt_level, options.half_dtype):
        notes.append(f"ampatch: dropping half_dtype={options.half_dtype}, which conflicts with forced "
                     f"{overrides.opt_level}.")
        options = options.replace(half_dtype=None)
    options = _outside_wins(options, overrides, notes)
    if not forced:
        return _build(options, device, hard), notes
    kept = options.replace(enabled=True, **dict.fromkeys(options.given()))  # a forced level runs, even disabled
    for name, value in options.given().items():
        trial = kept.replace(**{name: value})
        try:
            _build(trial, device, False)
        except ValueError as err:
            notes.append(f"ampatch: dropping {name}={False if value is NO_CAST else value!r}, which conflicts "
                         f"with forced {options.opt_level} ({err})")
            continue
        kept = trial
    return _build(kept, device, False), notes


def _outside_wins(options: Options, overrides: Overrides, notes: list[str]) -> Options:
    """The one rule of settings from outside: each replaces the script's keyword (with a note
    where the two differ); a half dtype the level cannot take is ignored (with a note)."""
    changes: dict[str, Any] = {}
    level = overrides.opt_level or options.opt_level
    for name in OUTSIDE:
        value = getattr(overrides, name)
        if value is None:
            continue
        if name == "half_dtype" and levels.half_dtype_conflict(level, value):
            notes.append(f"ampatch: {overrides.given(name)} does not apply to {level}, which always runs in "
                         "bfloat16; ignored.")
            continue
        mine = getattr(options, name)
        if mine is not None and mine != value:
            notes.append(f"ampatch: {overrides.given(name)} overrides the script's {name}={mine}.")
        changes[name] = value
    return options.replace(**changes) if changes else options


def _build(options: Options, device: Any, hard_override: bool) -> Properties:
    """The level's defaults with the keywords given, checked as a whole."""
    level, half, given = options.opt_level, options.half_dtype, options.given()
    conflict = levels.half_dtype_conflict(level, half)
    if conflict:
        raise ValueError(conflict)
    if half is None and options.cast_model_type in LOW:
        half = options.cast_model_type
    half = levels.half_dtype_for(level, device, half)
    table = levels.LEVELS[level]
    default_cast = half if table.cast_model_type == levels.HALF else table.cast_model_type
    default_scale = 1.0 if table.loss_scale == DYNAMIC and half == torch.bfloat16 else table.loss_scale  # FP32's range
    merged = {"cast_model_type": default_cast, "patch_torch_functions": table.patch_torch_functions,
              "keep_batchnorm_fp32": table.keep_batchnorm_fp32, "master_weights": table.master_weights,
              "loss_scale": default_scale, **given}
    _check(level, merged, given, half, hard_override)
    cast = merged["cast_model_type"]
    return Properties(
        enabled=options.enabled, opt_level=level, half_dtype=half,
        cast_model_type=None if cast is NO_CAST else cast,  # NO_CAST: the model stays as it came in
        patch_torch_functions=bool(merged["patch_torch_functions"]),
        keep_batchnorm_fp32=merged["keep_batchnorm_fp32"], master_weights=merged["master_weights"],
        loss_scale=merged["loss_scale"], cast_model_outputs=options.cast_model_outputs)


def _check(level: str, merged: dict[str, Any], given: dict[str, Any], half: torch.dtype,
           hard_override: bool) -> None:
    """Apex's checks of the overrides (`Properties.__setattr__` in its frontend.py): what Apex
    refused raises `OverrideError` (warns with `hard_override`); what it accepted is accepted.
    O4 is checked like O1, of which it is the bfloat16 variant. Then ampatch's low-memory
    master modes, which exist only for a bfloat16 model."""
    cmt = merged["cast_model_type"]
    model_cast = cmt not in (None, NO_CAST, torch.float32)
    mode = given.get("master_weights")
    if isinstance(mode, str):
        _check_low_memory(level, mode, cmt if model_cast else None)
    if level in levels.PATCHING_LEVELS:
        if mode is not None:
            warn_or_err(f"master_weights={mode} makes no sense with {level}: {level} keeps the model weights in "
                        "FP32 (they are their own masters), so leave it None. Use opt_level='O2' for a half model "
                        "with FP32 master weights.", hard_override)
        if model_cast:
            warn_or_err(f"{level} casts per op and keeps the model in FP32, so cast_model_type must be None, False "
                        f"or torch.float32, not {cmt}. Use opt_level='O2' or 'O3' to cast the model.", hard_override)
        if given.get("keep_batchnorm_fp32") is not None:
            warn_or_err(f"{level} already runs batch norm safely on FP32 weights; keep_batchnorm_fp32 must be "
                        "None. It applies to O2/O3/O5, which cast the model.", hard_override)
    elif given.get("patch_torch_functions"):
        warn_or_err(f"patch_torch_functions=True is only valid with O1/O4 (got {level}); patching torch "
                    "functions on top of a cast model double-casts. Use opt_level='O1' (or 'O4').", hard_override)
    if model_cast and cmt != half:
        raise ValueError(f"cast_model_type={cmt} conflicts with half_dtype={half}; pass only one of them.")


def _check_low_memory(level: str, mode: str, model_dtype: torch.dtype | None) -> None:
    """master_weights="stochastic"/"kahan": a bfloat16 model (O2, O3, O5) stepped without FP32
    copies. Anywhere else there is nothing for them to do, and float16's narrow range would
    turn small updates into zeros or overflows that no loss scale covers: refused."""
    what = f"master_weights={mode!r}"
    if model_dtype is None:
        raise ValueError(f"{what} applies where the model itself is cast to bfloat16 (O2, O3, O5), not to {level}, "
                         "whose model stays FP32. Use opt_level='O5' (or 'O2'/'O3' with half_dtype=torch.bfloat16) "
                         f"with {what}, or leave master_weights unset at {level}.")
    if model_dtype != torch.bfloat16:
        raise ValueError(f"{what} needs a bfloat16 model, but {level} here casts it to {short_name(model_dtype)}: "
                         "float16 has too few exponent bits for updates kept without FP32 masters (they "
                         "underflow, and no loss scale reaches the optimizer's step), so ampatch refuses rather "
                         f"than scale. Use opt_level='O5' (or half_dtype=torch.bfloat16) with {what}, or "
                         "master_weights=True for float16.")
