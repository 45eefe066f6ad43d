"""Opt levels O0-O5 as data, and the validation that turns a level plus overrides into
one consistent `Properties` object.

Policy only: nothing here touches a model or torch's namespaces. `resolve()` is the single
entry point; every bad combination raises with the reason and what to do instead.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger("ampatch")

DYNAMIC = "dynamic"
_HALF = "half"  # placeholder in the level table: the session's half dtype
_LEVEL_ENV = "AMPATCH_OPT_LEVEL"
_HALF_ENV = "AMPATCH_HALF_DTYPE"


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
_FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                "half": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(value: Any, what: str) -> torch.dtype | None:
    """Accept a torch float dtype or its name ("bfloat16", "torch.float16"); None passes."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in _FLOAT_TYPES:
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
    """A positive number, a numeric string, or "dynamic"."""
    if value is None or value == DYNAMIC:
        return value
    if isinstance(value, bool):
        raise TypeError("loss_scale must be a number, a numeric string or 'dynamic', not a bool.")
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ValueError(f"loss_scale={value!r}: use a number such as 128.0, or 'dynamic'.") from None
    if not isinstance(value, (int, float)):
        raise TypeError(f"loss_scale must be a number or 'dynamic', got {type(value).__name__}.")
    value = float(value)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"loss_scale must be a finite positive number, got {value}.")
    return value


def default_half_dtype(device: torch.device | None) -> torch.dtype:
    """float16 where matmul in float16 is fast (CUDA), bfloat16 elsewhere (CPU)."""
    if device is not None and device.type == "cuda":
        return torch.float16
    return torch.bfloat16


def forced_level() -> str | None:
    """The level forced from outside through AMPATCH_OPT_LEVEL (the `ampatch` command)."""
    level = os.environ.get(_LEVEL_ENV)
    if not level:
        return None
    level = level.strip().upper()
    if level not in LEVELS:
        raise ValueError(f"{_LEVEL_ENV}={level!r} is not an opt level; use one of {', '.join(LEVELS)}.")
    return level


def resolve(opt_level: str = "O1", *, device: torch.device | None = None, enabled: bool = True,
            half_dtype: Any = None, cast_model_outputs: Any = None, **overrides: Any) -> Properties:
    """Turn a level and property overrides into validated `Properties`.

    `overrides` are the property keywords of `initialize` (cast_model_type,
    patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale); None means
    "the level's default". A level forced by AMPATCH_OPT_LEVEL wins; overrides that
    conflict with it are dropped and logged.
    """
    if not isinstance(opt_level, str):
        raise TypeError(f"opt_level must be a string such as 'O1', got {type(opt_level).__name__}.")
    level = opt_level.strip().upper()
    if level not in LEVELS:
        raise ValueError(f"Unknown opt_level {opt_level!r}; valid levels are {', '.join(LEVELS)}"
                         " (O0 FP32, O1 patched casts, O2 half model + FP32 masters, O3 pure half,"
                         " O4/O5 = O1/O2 in bfloat16).")
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}.")
    if os.environ.get(_HALF_ENV):
        half_dtype = parse_dtype(os.environ[_HALF_ENV], _HALF_ENV)
    half = parse_dtype(half_dtype, "half_dtype")
    if half == torch.float32:
        raise ValueError("half_dtype=torch.float32 is not a half type; use opt_level='O0' for FP32.")
    clean = {
        "cast_model_type": parse_dtype(overrides.pop("cast_model_type", None), "cast_model_type"),
        "patch_torch_functions": _parse_bool(overrides.pop("patch_torch_functions", None), "patch_torch_functions"),
        "keep_batchnorm_fp32": _parse_bool(overrides.pop("keep_batchnorm_fp32", None), "keep_batchnorm_fp32"),
        "master_weights": _parse_bool(overrides.pop("master_weights", None), "master_weights"),
        "loss_scale": parse_loss_scale(overrides.pop("loss_scale", None)),
    }
    if overrides:
        raise TypeError(f"Unknown property keyword(s): {', '.join(sorted(overrides))}.")
    outputs = parse_dtype(cast_model_outputs, "cast_model_outputs")

    forced = forced_level()
    if forced is not None:
        if forced != level:
            logger.warning("ampatch: %s=%s overrides the script's opt_level=%s.", _LEVEL_ENV, forced, level)
        level, enabled = forced, True
        return _resolve_forced(level, device, half, outputs, clean)
    return _build(level, device, half, outputs, clean, enabled)


def _resolve_forced(level: str, device, half, outputs, clean: dict) -> Properties:
    """Apply the script's overrides one by one, dropping (and logging) each that conflicts."""
    if half is not None and level in BFLOAT16_LEVELS and half != torch.bfloat16:
        logger.warning("ampatch: dropping half_dtype=%s, which conflicts with forced %s.", half, level)
        half = None
    kept: dict[str, Any] = {}
    for name, value in clean.items():
        if value is None:
            continue
        try:
            _build(level, device, half, outputs, {**kept, name: value}, True)
        except ValueError as err:
            logger.warning("ampatch: dropping %s=%r, which conflicts with forced %s (%s)", name, value, level, err)
            continue
        kept[name] = value
    return _build(level, device, half, outputs, kept, True)


def _build(level: str, device, half, outputs, overrides: dict, enabled: bool) -> Properties:
    """Merge the level's defaults with non-None overrides, then check the combination."""
    cmt_override = overrides.get("cast_model_type")
    if level in BFLOAT16_LEVELS:
        if half == torch.float16:
            raise ValueError(f"{level} is the bfloat16 variant of {'O1' if level == 'O4' else 'O2'}; "
                             f"half_dtype=torch.float16 contradicts it. Use opt_level="
                             f"'{'O1' if level == 'O4' else 'O2'}' with half_dtype=torch.float16.")
        half = torch.bfloat16
    if half is None and cmt_override in (torch.float16, torch.bfloat16):
        half = cmt_override
    if half is None:
        half = default_half_dtype(device)

    props = dict(LEVELS[level])
    if props["cast_model_type"] == _HALF:
        props["cast_model_type"] = half
    if props["loss_scale"] == DYNAMIC and half == torch.bfloat16:
        props["loss_scale"] = 1.0  # bfloat16 has FP32's exponent range: no scaling needed
    for name, value in overrides.items():
        if value is not None:
            props[name] = value
    _check(level, props, overrides, half)
    return Properties(
        enabled=enabled, opt_level=level, half_dtype=half,
        cast_model_type=props["cast_model_type"],
        patch_torch_functions=bool(props["patch_torch_functions"]),
        keep_batchnorm_fp32=props["keep_batchnorm_fp32"],
        master_weights=props["master_weights"],
        loss_scale=props["loss_scale"], cast_model_outputs=outputs,
    )


def _check(level: str, props: dict, overrides: dict, half: torch.dtype) -> None:
    """Reject combinations that make no sense, naming the level that does what was meant."""
    cmt = props["cast_model_type"]
    model_cast = cmt is not None and cmt != torch.float32
    if level in PATCHING_LEVELS:
        if overrides.get("master_weights"):
            raise ValueError(f"master_weights=True makes no sense with {level}: {level} keeps the model "
                             "weights in FP32 (they are their own masters). Use opt_level='O2' for a half "
                             "model with FP32 master weights.")
        if model_cast:
            raise ValueError(f"{level} casts per op and keeps the model in FP32, so cast_model_type must be "
                             f"None or torch.float32, not {cmt}. Use opt_level='O2' or 'O3' to cast the model.")
        if overrides.get("keep_batchnorm_fp32") is not None:
            raise ValueError(f"{level} already runs batch norm safely on FP32 weights; keep_batchnorm_fp32 "
                             "must be None. It applies to O2/O3/O5, which cast the model.")
    elif overrides.get("patch_torch_functions"):
        raise ValueError(f"patch_torch_functions=True is only valid with O1/O4 (got {level}); patching torch "
                         "functions on top of a cast model double-casts. Use opt_level='O1' (or 'O4').")
    if cmt is not None and cmt != torch.float32 and cmt != half:
        raise ValueError(f"cast_model_type={cmt} conflicts with half_dtype={half}; pass only one of them.")
    if not model_cast:
        if overrides.get("master_weights"):
            raise ValueError(f"master_weights=True needs a model cast to half, but {level} keeps it in FP32. "
                             "Use opt_level='O2' (or 'O5').")
        if overrides.get("keep_batchnorm_fp32") is not None and level not in PATCHING_LEVELS:
            raise ValueError(f"keep_batchnorm_fp32 only applies when the model is cast to half (O2/O3/O5); "
                             f"{level} keeps the whole model in FP32. Leave it as None.")
