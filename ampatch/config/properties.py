"""A level plus the keywords that override it, checked into one consistent `Properties`.

`resolve()` is the single entry point. Property values mean what they meant in Apex
(`frontend.py`'s `Properties`): `cast_model_type=False` leaves the model uncast at any level;
`keep_batchnorm_fp32` takes "True"/"False"; `loss_scale` takes numbers, numeric strings and
"dynamic". The overrides Apex refused (its `warn_or_err`) raise `OverrideError`, or only warn
when `hard_override=True` (Apex's `_amp_state.hard_override`).

Settings from outside (`env.Overrides`: ``AMPATCH_OPT_LEVEL`` and the rest, a policy file
applied with ``AMPATCH_POLICY``) beat the script by one rule, written once here: a forced
level wins, and each of the script's keywords that conflicts with it is dropped, with a note.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..base.dtypes import LOW, short_name
from ..base.notices import warn
from . import levels
from .values import DYNAMIC, MasterMode, parse_bool, parse_dtype, parse_loss_scale, parse_master_weights

if TYPE_CHECKING:  # env reads the environment with the parsers this module uses
    from .env import Overrides

logger = logging.getLogger("ampatch")

__all__ = ["Properties", "OverrideError", "warn_or_err", "resolve", "NO_CAST"]

NO_CAST = "no cast"  # cast_model_type=False: Apex's "leave the model as it is", at any level


class OverrideError(ValueError, RuntimeError):
    """An override Apex refused (its `warn_or_err`): a ValueError like every configuration
    error here, and the RuntimeError Apex raised. `hard_override=True` makes it a warning."""


def warn_or_err(message: str, hard_override: bool = False) -> None:
    """Apex's rule: raise, unless the user asked for `_amp_state.hard_override = True`."""
    if not hard_override:
        raise OverrideError(message)
    warn(f"ampatch: hard_override: {message}")


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
    def master_mode(self) -> MasterMode:
        """What keeps the exact weights of half parameters: FP32 copies (`master_weights=True`:
        of the params the cast makes half, and of half params passed in with Apex's
        `allow_incoming_model_not_fp32`), a low-memory mode, or none (O0/O1/O4: the FP32 model
        is its own master; O3)."""
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


@dataclass(frozen=True)
class Requested:
    """The property keywords of a call, parsed; None means "the level's default"."""

    cast_model_type: torch.dtype | str | None = None  # NO_CAST: Apex's cast_model_type=False
    patch_torch_functions: bool | None = None
    keep_batchnorm_fp32: bool | None = None
    master_weights: bool | str | None = None
    loss_scale: float | str | None = None

    @classmethod
    def parse(cls, cast_model_type: Any = None, patch_torch_functions: Any = None, keep_batchnorm_fp32: Any = None,
              master_weights: Any = None, loss_scale: Any = None) -> "Requested":
        return cls(NO_CAST if cast_model_type is False else parse_dtype(cast_model_type, "cast_model_type"),
                   parse_bool(patch_torch_functions, "patch_torch_functions"),
                   parse_bool(keep_batchnorm_fp32, "keep_batchnorm_fp32"),
                   parse_master_weights(master_weights), parse_loss_scale(loss_scale))

    def given(self) -> dict[str, Any]:
        """The keywords that were given (not None), in the signature's order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


def resolve(opt_level: str = "O1", *, device: torch.device | None = None, enabled: bool = True,
            half_dtype: Any = None, cast_model_outputs: Any = None, hard_override: bool = False,
            overrides: "Overrides | None" = None, notes: list[str] | None = None, **properties: Any) -> Properties:
    """Turn a level and the property keywords of `initialize` (cast_model_type,
    patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale; None: the level's
    default) into validated `Properties`.

    An override Apex refused raises `OverrideError` (a warning with `hard_override=True`).
    `overrides` (`env.read()`; None: none) come from outside: a forced level wins and the
    script's keywords that conflict with it are dropped; a forced loss scale or half dtype
    replaces the script's. What that changed is appended to `notes` when a list is given
    (`initialize` logs them once the logger follows the new session's verbosity), else logged.
    """
    try:
        level = levels.normalize(opt_level)
    except ValueError as exc:
        raise OverrideError(str(exc)) from None
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}.")
    unknown = set(properties) - {f.name for f in dataclasses.fields(Requested)}
    if unknown:
        raise TypeError(f"Unknown property keyword(s): {', '.join(sorted(unknown))}.")
    requested = Requested.parse(**properties)
    said: list[str] = [] if notes is None else notes
    outputs = parse_dtype(cast_model_outputs, "cast_model_outputs")
    half = parse_dtype(half_dtype, "half_dtype")
    forced = overrides.opt_level if overrides is not None else None
    if overrides is not None:
        if overrides.loss_scale is not None:  # `ampatch diagnose` verifies its advice this way
            if requested.loss_scale is not None and requested.loss_scale != overrides.loss_scale:
                said.append(f"ampatch: {overrides.given('loss_scale')} overrides the script's "
                            f"loss_scale={requested.loss_scale}.")
            requested = dataclasses.replace(requested, loss_scale=overrides.loss_scale)
        if overrides.master_weights is not None:  # tune's low-memory candidates run this way
            if requested.master_weights is not None and requested.master_weights != overrides.master_weights:
                said.append(f"ampatch: {overrides.given('master_weights')} overrides the script's "
                            f"master_weights={requested.master_weights!r}.")
            requested = dataclasses.replace(requested, master_weights=overrides.master_weights)
        if overrides.half_dtype is not None:
            if levels.half_dtype_conflict(forced or level, overrides.half_dtype):  # ignored, and said
                said.append(f"ampatch: {overrides.given('half_dtype')} does not apply to {forced or level}, "
                            f"which always runs in bfloat16; ignored.")
            else:
                half = overrides.half_dtype
    if half == torch.float32:
        raise ValueError("half_dtype=torch.float32 is not a half type; use opt_level='O0' for FP32.")
    if forced is not None:
        if forced != level:
            said.append(f"ampatch: {overrides.given('opt_level')} overrides the script's opt_level={level}.")
        props = _resolve_forced(forced, device, half, outputs, requested, said)
    else:
        props = _build(level, device, half, outputs, requested, enabled, hard_override)
    if notes is None:
        for note in said:
            logger.warning(note)
    return props


def _resolve_forced(level: str, device: Any, half: torch.dtype | None, outputs: torch.dtype | None,
                    requested: Requested, notes: list[str]) -> Properties:
    """Outside beats the script: apply the script's keywords one by one, dropping each that
    conflicts with the forced `level` (with a note)."""
    if levels.half_dtype_conflict(level, half):
        notes.append(f"ampatch: dropping half_dtype={half}, which conflicts with forced {level}.")
        half = None
    kept = Requested()
    for name, value in requested.given().items():
        trial = dataclasses.replace(kept, **{name: value})
        try:
            _build(level, device, half, outputs, trial, True)
        except ValueError as err:
            notes.append(f"ampatch: dropping {name}={False if value is NO_CAST else value!r}, which conflicts "
                         f"with forced {level} ({err})")
            continue
        kept = trial
    return _build(level, device, half, outputs, kept, True)


def _build(level: str, device: Any, half: torch.dtype | None, outputs: torch.dtype | None, requested: Requested,
           enabled: bool, hard_override: bool = False) -> Properties:
    """The level's defaults with the keywords given, checked as a whole."""
    conflict = levels.half_dtype_conflict(level, half)
    if conflict:
        raise ValueError(conflict)
    if half is None and requested.cast_model_type in LOW:
        half = requested.cast_model_type
    half = levels.half_dtype_for(level, device, half)
    table = levels.LEVELS[level]
    default_cast = half if table.cast_model_type == levels.HALF else table.cast_model_type
    default_scale = 1.0 if table.loss_scale == DYNAMIC and half == torch.bfloat16 else table.loss_scale  # FP32's range
    given = requested.given()
    merged = {"cast_model_type": default_cast, "patch_torch_functions": table.patch_torch_functions,
              "keep_batchnorm_fp32": table.keep_batchnorm_fp32, "master_weights": table.master_weights,
              "loss_scale": default_scale, **given}
    _check(level, merged, requested, half, hard_override)
    cast = merged["cast_model_type"]
    return Properties(
        enabled=enabled, opt_level=level, half_dtype=half,
        cast_model_type=None if cast is NO_CAST else cast,  # NO_CAST: the model stays as it came in
        patch_torch_functions=bool(merged["patch_torch_functions"]),
        keep_batchnorm_fp32=merged["keep_batchnorm_fp32"], master_weights=merged["master_weights"],
        loss_scale=merged["loss_scale"], cast_model_outputs=outputs)


def _check(level: str, merged: dict[str, Any], requested: Requested, half: torch.dtype,
           hard_override: bool = False) -> None:
    """Apex's checks of the overrides (`Properties.__setattr__` in its frontend.py), value by
    value: what Apex refused raises `OverrideError` (warns with `hard_override`); what it
    accepted is accepted. O4 is checked like O1, of which it is the bfloat16 variant. Then
    ampatch's own low-memory master modes, which exist only for a bfloat16 model."""
    cmt = merged["cast_model_type"]
    model_cast = cmt not in (None, NO_CAST, torch.float32)
    mode = requested.master_weights
    if isinstance(mode, str):
        _check_low_memory(level, mode, cmt if model_cast else None)
    if level in levels.PATCHING_LEVELS:
        if requested.master_weights is not None:
            warn_or_err(f"master_weights={requested.master_weights} makes no sense with {level}: {level} keeps "
                        "the model weights in FP32 (they are their own masters), so leave it None. Use "
                        "opt_level='O2' for a half model with FP32 master weights.", hard_override)
        if model_cast:
            warn_or_err(f"{level} casts per op and keeps the model in FP32, so cast_model_type must be None, False "
                        f"or torch.float32, not {cmt}. Use opt_level='O2' or 'O3' to cast the model.", hard_override)
        if requested.keep_batchnorm_fp32 is not None:
            warn_or_err(f"{level} already runs batch norm safely on FP32 weights; keep_batchnorm_fp32 must be "
                        "None. It applies to O2/O3/O5, which cast the model.", hard_override)
    elif requested.patch_torch_functions:
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
