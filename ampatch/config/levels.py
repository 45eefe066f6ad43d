"""Opt levels O0-O5 as data, and the validation that turns a level plus overrides into
one consistent `Properties` object.

Policy only: nothing here changes a model or torch's namespaces. `resolve()` is the single
entry point; every bad combination raises with the reason and what to do instead.

Property values mean what they meant in Apex (`frontend.py`'s `Properties`): `cast_model_type=False`
leaves the model uncast at any level; `keep_batchnorm_fp32` takes "True"/"False"; `loss_scale`
takes numbers, numeric strings and "dynamic". The overrides Apex refused (its `warn_or_err`)
raise `OverrideError`, or only warn when `hard_override=True` (Apex's
`_amp_state.hard_override`); `check_models` is Apex's refusal of half models.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..base.dtypes import FLOATS, LOW, short_name
from ..base.notices import warn
from ..optim.scaler import check_scale_value

if TYPE_CHECKING:  # env reads the environment with this module's parsers: it imports levels
    from .env import Overrides

logger = logging.getLogger("ampatch")

DYNAMIC = "dynamic"
_HALF = "half"  # placeholder in the level table: the session's half dtype
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
    master_weights: bool | None  # None at O1/O4 as in the table: the FP32 model is its own master
    loss_scale: float | str
    cast_model_outputs: torch.dtype | None = None

    @property
    def casts_model(self) -> bool:
        """True when the model itself is converted to a half type (O2, O3, O5)."""
        return self.cast_model_type is not None and self.cast_model_type != torch.float32

    def __str__(self) -> str:
        fields = (f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return "Properties(" + ", ".join(fields) + ")"


# Each level's defaults. "half" resolves to the session's half dtype.
LEVELS: dict[str, dict[str, Any]] = {
    "O0": dict(cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale=DYNAMIC),
    "O2": dict(cast_model_type=_HALF, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale=DYNAMIC),
    "O3": dict(cast_model_type=_HALF, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
    "O4": dict(cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale=1.0),
    "O5": dict(cast_model_type=_HALF, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale=1.0),
}
BFLOAT16_LEVELS = ("O4", "O5")
PATCHING_LEVELS = ("O1", "O4")
_DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                "half": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(value: Any, what: str) -> torch.dtype | None:
    """Accept a torch float dtype or its name ("bfloat16", "torch.float16"); None passes."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in FLOATS:
            raise ValueError(f"{what} must be torch.float32, torch.float16 or torch.bfloat16, got {value}.")
        return value
    if isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ValueError(f"{what}={value!r} is not a float dtype; use 'float32', 'float16' or 'bfloat16'.")
    raise TypeError(f"{what} must be a torch.dtype (e.g. torch.bfloat16) or None, got {type(value).__name__}.")


class BadFlagString(ValueError, TypeError):
    """A flag given as a string other than "True"/"False": a bad value of an accepted type,
    or the wrong type for a flag; both exception types catch it."""


def _parse_bool(value: Any, what: str) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value in ("True", "False"):
            return value == "True"
        raise BadFlagString(f"{what}={value!r}: use True or False (or the strings 'True' / 'False').")
    raise TypeError(f"{what} must be True, False, 'True', 'False' or None, got {value!r}.")


def parse_loss_scale(value: Any) -> float | str | None:
    """A usable scale given as a number (numpy scalars and 0-dim tensors too, as float() took
    them in Apex) or a numeric string, or "dynamic"."""
    if value is None or value == DYNAMIC:
        return value
    if isinstance(value, bool):
        raise TypeError("loss_scale must be a number, a numeric string or 'dynamic', not a bool.")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"loss_scale={value!r}: use a number such as 128.0, or 'dynamic'.") from None
    else:
        try:
            value = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise TypeError(f"loss_scale must be a number or 'dynamic', got {type(value).__name__}.") from None
    return check_scale_value(value, "loss_scale")


def default_half_dtype(device: torch.device | None) -> torch.dtype:
    """float16 where matmul in float16 is fast (CUDA), bfloat16 elsewhere (CPU)."""
    if device is not None and device.type == "cuda":
        return torch.float16
    return torch.bfloat16


def fixed_half_dtype(level: str) -> torch.dtype | None:
    """The half dtype `level` always uses, or None where it is the session's choice: the one
    statement of the rule "O4/O5 use bfloat16" (they are O1/O2 in bfloat16, by definition)."""
    return torch.bfloat16 if level in BFLOAT16_LEVELS else None


def half_dtype_conflict(level: str, half: Any) -> str | None:
    """Why `half` (a dtype or its name; None and "auto" never conflict) contradicts `level`
    under `fixed_half_dtype`, or None when it does not. Each caller decides what a conflict
    does (initialize raises, a forced level drops the script's choice, the command refuses)."""
    fixed = fixed_half_dtype(level)
    if fixed is None or half is None or (isinstance(half, str) and half.strip().lower() == "auto"):
        return None
    half = parse_dtype(half, "half_dtype")
    if half == fixed:
        return None
    base = "O1" if level == "O4" else "O2"
    return (f"{level} is the {short_name(fixed)} variant of {base}; half_dtype={half} contradicts it. Use "
            f"opt_level='{base}' with half_dtype={half}.")


def half_dtype_for(level: str, device: torch.device | str | None, requested: Any = None) -> torch.dtype:
    """The half dtype of `level` on `device`: the level's own (`fixed_half_dtype`); else
    `requested` (a dtype or its name; None or "auto": the device's default, see
    `default_half_dtype`). At O0, which runs FP32, it is the dtype its overrides would use.
    The one rule `initialize` and the `ampatch` command share."""
    fixed = fixed_half_dtype(level)
    if fixed is not None:
        return fixed
    if isinstance(requested, str) and requested.strip().lower() == "auto":
        requested = None
    half = parse_dtype(requested, "half_dtype")
    if half is not None:
        return half
    return default_half_dtype(torch.device(device) if isinstance(device, str) else device)


def resolve(opt_level: str = "O1", *, device: torch.device | None = None, enabled: bool = True,
            half_dtype: Any = None, cast_model_outputs: Any = None, hard_override: bool = False,
            overrides: "Overrides | None" = None, **properties: Any) -> Properties:
    """Turn a level and property overrides into validated `Properties`, logging what the
    environment's `overrides` changed (see `resolve_with_notes`)."""
    props, notes = resolve_with_notes(opt_level, device=device, enabled=enabled, half_dtype=half_dtype,
                                      cast_model_outputs=cast_model_outputs, hard_override=hard_override,
                                      overrides=overrides, **properties)
    for note in notes:
        logger.warning(note)
    return props


def resolve_with_notes(opt_level: str = "O1", *, device: torch.device | None = None, enabled: bool = True,
                       half_dtype: Any = None, cast_model_outputs: Any = None, hard_override: bool = False,
                       overrides: "Overrides | None" = None, **properties: Any) -> tuple[Properties, list[str]]:
    """Turn a level and property overrides into validated `Properties`, and the warnings to
    log about it (returned, not logged: `initialize` checks everything before it changes the
    logger's level to the call's verbosity, then logs them).

    `properties` are the property keywords of `initialize` (cast_model_type,
    patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale); None means
    "the level's default". An override Apex refused raises `OverrideError` (a warning with
    `hard_override=True`). `overrides` (`env.read()`; None: none) come from outside: a
    forced level wins, and the script's properties that conflict with it are dropped, each
    with a note; a forced loss scale or half dtype replaces the script's.
    """
    if not isinstance(opt_level, str):
        raise TypeError(f"opt_level must be a string such as 'O1', got {type(opt_level).__name__}.")
    level = opt_level.strip().upper()
    if level not in LEVELS:
        raise OverrideError(f"Unknown opt_level {opt_level!r}; valid levels are {', '.join(LEVELS)}"
                            " (O0 FP32, O1 patched casts, O2 half model + FP32 masters, O3 pure half,"
                            " O4/O5 = O1/O2 in bfloat16).")
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}.")
    cast_model_type = properties.pop("cast_model_type", None)
    clean = {
        "cast_model_type": NO_CAST if cast_model_type is False else parse_dtype(cast_model_type, "cast_model_type"),
        "patch_torch_functions": _parse_bool(properties.pop("patch_torch_functions", None), "patch_torch_functions"),
        "keep_batchnorm_fp32": _parse_bool(properties.pop("keep_batchnorm_fp32", None), "keep_batchnorm_fp32"),
        "master_weights": _parse_bool(properties.pop("master_weights", None), "master_weights"),
        "loss_scale": parse_loss_scale(properties.pop("loss_scale", None)),
    }
    if properties:
        raise TypeError(f"Unknown property keyword(s): {', '.join(sorted(properties))}.")
    notes: list[str] = []
    outputs = parse_dtype(cast_model_outputs, "cast_model_outputs")
    half = parse_dtype(half_dtype, "half_dtype")
    forced = None
    if overrides is not None:
        forced = overrides.opt_level
        if overrides.loss_scale is not None:  # `ampatch diagnose` verifies its advice this way
            if clean["loss_scale"] is not None and clean["loss_scale"] != overrides.loss_scale:
                notes.append(f"ampatch: {overrides.given('loss_scale')} overrides the script's "
                             f"loss_scale={clean['loss_scale']}.")
            clean["loss_scale"] = overrides.loss_scale
        if overrides.half_dtype is not None:
            conflict = half_dtype_conflict(forced or level, overrides.half_dtype)
            if conflict:  # like a conflicting override under a forced level: ignored, and said
                notes.append(f"ampatch: {overrides.given('half_dtype')} does not apply to {forced or level}, "
                             f"which always runs in bfloat16; ignored.")
            else:
                half = overrides.half_dtype
    if half == torch.float32:
        raise ValueError("half_dtype=torch.float32 is not a half type; use opt_level='O0' for FP32.")
    if forced is not None:
        if forced != level:
            notes.append(f"ampatch: {overrides.given('opt_level')} overrides the script's opt_level={level}.")
        return _resolve_forced(forced, device, half, outputs, clean, notes), notes
    return _build(level, device, half, outputs, clean, enabled, hard_override), notes


def _resolve_forced(level: str, device, half, outputs, clean: dict, notes: list[str]) -> Properties:
    """Apply the script's overrides one by one, dropping each that conflicts (with a note)."""
    if half_dtype_conflict(level, half):
        notes.append(f"ampatch: dropping half_dtype={half}, which conflicts with forced {level}.")
        half = None
    kept: dict[str, Any] = {}
    for name, value in clean.items():
        if value is None:
            continue
        try:
            _build(level, device, half, outputs, {**kept, name: value}, True)
        except ValueError as err:
            notes.append(f"ampatch: dropping {name}={False if value is NO_CAST else value!r}, which conflicts "
                         f"with forced {level} ({err})")
            continue
        kept[name] = value
    return _build(level, device, half, outputs, kept, True)


def _build(level: str, device, half, outputs, overrides: dict, enabled: bool,
           hard_override: bool = False) -> Properties:
    """Merge the level's defaults with non-None overrides, then check the combination."""
    cmt_override = overrides.get("cast_model_type")
    conflict = half_dtype_conflict(level, half)
    if conflict:
        raise ValueError(conflict)
    if half is None and cmt_override in LOW:
        half = cmt_override
    half = half_dtype_for(level, device, half)

    props = dict(LEVELS[level])
    if props["cast_model_type"] == _HALF:
        props["cast_model_type"] = half
    if props["loss_scale"] == DYNAMIC and half == torch.bfloat16:
        props["loss_scale"] = 1.0  # bfloat16 has FP32's exponent range: no scaling needed
    for name, value in overrides.items():
        if value is not None:
            props[name] = value
    _check(level, props, overrides, half, hard_override)
    if props["cast_model_type"] is NO_CAST:
        props["cast_model_type"] = None  # the model stays as it came in
    return Properties(
        enabled=enabled, opt_level=level, half_dtype=half,
        cast_model_type=props["cast_model_type"],
        patch_torch_functions=bool(props["patch_torch_functions"]),
        keep_batchnorm_fp32=props["keep_batchnorm_fp32"],
        master_weights=props["master_weights"],
        loss_scale=props["loss_scale"], cast_model_outputs=outputs,
    )


def _check(level: str, props: dict, overrides: dict, half: torch.dtype, hard_override: bool = False) -> None:
    """Apex's checks of the overrides (`Properties.__setattr__` in its frontend.py), value by
    value: what Apex refused raises `OverrideError` (warns with `hard_override`); what it
    accepted is accepted. O4 is checked like O1, of which it is the bfloat16 variant."""
    cmt = props["cast_model_type"]
    model_cast = cmt not in (None, NO_CAST, torch.float32)
    if level in PATCHING_LEVELS:
        if overrides.get("master_weights") is not None:
            warn_or_err(f"master_weights={overrides['master_weights']} makes no sense with {level}: {level} keeps "
                        "the model weights in FP32 (they are their own masters), so leave it None. Use "
                        "opt_level='O2' for a half model with FP32 master weights.", hard_override)
        if model_cast:
            warn_or_err(f"{level} casts per op and keeps the model in FP32, so cast_model_type must be None, False "
                        f"or torch.float32, not {cmt}. Use opt_level='O2' or 'O3' to cast the model.", hard_override)
        if overrides.get("keep_batchnorm_fp32") is not None:
            warn_or_err(f"{level} already runs batch norm safely on FP32 weights; keep_batchnorm_fp32 must be "
                        "None. It applies to O2/O3/O5, which cast the model.", hard_override)
    elif overrides.get("patch_torch_functions"):
        warn_or_err(f"patch_torch_functions=True is only valid with O1/O4 (got {level}); patching torch "
                    "functions on top of a cast model double-casts. Use opt_level='O1' (or 'O4').", hard_override)
    if model_cast and cmt != half:
        raise ValueError(f"cast_model_type={cmt} conflicts with half_dtype={half}; pass only one of them.")


def check_models(models: Iterable[torch.nn.Module], allow_not_fp32: bool = False, hard_override: bool = False) -> None:
    """Apex's refusal of float16 models: `initialize` takes the FP32 model and does the casting
    itself. `_amp_state.allow_incoming_model_not_fp32 = True` lets float16 params and buffers
    in (they then get FP32 master weights where master weights are on)."""
    if allow_not_fp32:
        return
    for model in models:
        tensors = [("param", n, t) for n, t in model.named_parameters()]
        tensors += [("buffer", n, t) for n, t in model.named_buffers()]
        for kind, name, t in tensors:
            if t.dtype == torch.float16:
                warn_or_err(f"Found {kind} {name} of dtype {t.dtype}; amp.initialize expects an FP32 model and "
                            "does any casting itself: do not call .half() on the model before passing it. To "
                            "pass float16 parameters on purpose, set amp._amp_state.allow_incoming_model_not_fp32 "
                            "= True before amp.initialize.", hard_override)
                return
