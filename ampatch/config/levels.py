"""Opt levels O0-O5 as data, and the rules about their half dtype, each written once.

- `LEVELS`: each level's defaults (`Level`), as DESIGN.md's table gives them;
- `normalize(text)`: " o2 " -> "O2", or a ValueError listing the levels;
- `fixed_half_dtype` / `half_dtype_conflict`: O4/O5 are O1/O2 in bfloat16, by definition;
- `default_half_dtype` / `half_dtype_for`: float16 on CUDA, bfloat16 elsewhere, unless asked;
- `half_name(level, dtype)`: the half dtype a level runs in, by name; None at O0 (FP32);
- `variant(text)`: a level as the command line's `--levels` names it, with a low-memory master
  mode and/or FP8 ("O5+kahan", "O5+fp8", "O5+fp8:rowwise" -> `Variant`), and `variant_label` back.

Data and pure functions only: `options.resolve` turns a level plus overrides into a
session's `Properties`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch

from ..base.dtypes import short_name
from ..errors import ConfigError, ConfigTypeError
from .values import DYNAMIC, FP8_RECIPES, LOW_MEMORY_MODES, STATE_PRECISIONS, parse_dtype

if TYPE_CHECKING:
    from ..types import OptLevel

__all__ = ["HALF", "Level", "LEVELS", "BFLOAT16_LEVELS", "PATCHING_LEVELS", "FP32_LEVEL", "normalize",
           "fixed_half_dtype", "half_dtype_conflict", "default_half_dtype", "half_dtype_for", "uses_half",
           "half_name", "Variant", "variant", "variant_label", "CASTING_LEVELS", "FP8_VARIANT"]

HALF = "half"  # in the table: the session's half dtype
FP32_LEVEL = "O0"  # the one level without a half dtype


@dataclass(frozen=True)
class Level:
    """One level's defaults (Apex's `amp` properties); `cast_model_type` may be `HALF`."""

    cast_model_type: torch.dtype | str | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool | None  # None at O1/O4: the FP32 model is its own master
    loss_scale: float | str


LEVELS: dict[str, Level] = {
    "O0": Level(torch.float32, False, None, False, 1.0),
    "O1": Level(None, True, None, None, DYNAMIC),
    "O2": Level(HALF, False, True, True, DYNAMIC),
    "O3": Level(HALF, False, False, False, 1.0),
    "O4": Level(None, True, None, None, 1.0),
    "O5": Level(HALF, False, True, True, 1.0),
}
BFLOAT16_LEVELS = ("O4", "O5")
PATCHING_LEVELS = ("O1", "O4")
CASTING_LEVELS = ("O2", "O3", "O5")  # the model itself is cast to half
VARIANT = "+"  # "O5+kahan", "O5+int8", "O5+fp8": a level with a master mode, state precision or FP8 (--levels)
FP8_VARIANT = "fp8"  # "O5+fp8" (initialize's fp8=True), "O5+fp8:rowwise" (that recipe)
DESCRIPTION = ("O0 FP32, O1 patched casts, O2 half model + FP32 masters, O3 pure half, O4/O5 = O1/O2 in "
               "bfloat16")


def normalize(text: Any, what: str = "opt_level") -> OptLevel:
    """The level `text` names ("o2 " -> "O2"): the one reading of a level wherever it is
    written. A non-string raises TypeError; an unknown level ValueError listing the levels."""
    if not isinstance(text, str):
        raise ConfigTypeError(f"{what} must be a string such as 'O1', got {type(text).__name__}.")
    level = text.strip().upper()
    if level not in LEVELS:
        zero = f" ({'O' + level[1:]!r}: the letter O, not the digit zero)" if "O" + level[1:] in LEVELS else ""
        raise ConfigError(f"Unknown {what} {text!r}{zero}; valid levels are {', '.join(LEVELS)} ({DESCRIPTION}).")
    return cast("OptLevel", level)  # one of LEVELS' keys, checked above


def uses_half(level: str) -> bool:
    """Every level but O0 runs something in a half dtype."""
    return level != FP32_LEVEL


def half_name(level: str, dtype: torch.dtype | str | None) -> str | None:
    """The name of the half dtype `level` runs in ("bfloat16"), None at O0 (FP32) or for None:
    what reports, policies and the command's rows write."""
    if not uses_half(level) or dtype is None:
        return None
    return dtype if isinstance(dtype, str) else short_name(dtype)


def default_half_dtype(device: torch.device | None) -> torch.dtype:
    """float16 where matmul in float16 is fast (CUDA), bfloat16 elsewhere (CPU)."""
    if device is not None and device.type == "cuda":
        return torch.float16
    return torch.bfloat16


def fixed_half_dtype(level: str) -> torch.dtype | None:
    """The half dtype `level` always uses, or None where it is the session's choice: the one
    statement of the rule "O4/O5 use bfloat16" (they are O1/O2 in bfloat16, by definition)."""
    return torch.bfloat16 if level in BFLOAT16_LEVELS else None


def _is_auto(half: Any) -> bool:
    return half is None or (isinstance(half, str) and half.strip().lower() == "auto")


def half_dtype_conflict(level: str, half: Any) -> str | None:
    """Why `half` (a dtype or its name; None and "auto" never conflict) contradicts `level`
    under `fixed_half_dtype`, or None when it does not. Each caller decides what a conflict
    does (initialize raises, a forced level drops the script's choice, the command refuses)."""
    fixed = fixed_half_dtype(level)
    if fixed is None or _is_auto(half):
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
    half = None if _is_auto(requested) else parse_dtype(requested, "half_dtype")
    if half is not None:
        return half
    return default_half_dtype(torch.device(device) if isinstance(device, str) else device)


class Variant(NamedTuple):
    """A level as `--levels` names it: the level, a low-memory master mode (None: the level's
    own masters), FP8: None (off), True ("+fp8": initialize's `fp8=True`, tensorwise; in
    `tune`, each recipe) or a recipe name ("+fp8:rowwise"), and the optimizer state's
    precision ("+int8": optimizer_states="int8"; None: the script's own)."""

    level: OptLevel
    master_weights: str | None = None
    fp8: str | bool | None = None
    optimizer_states: str | None = None

    @property
    def label(self) -> str:
        """"O5", "O5+kahan", "O5+int8", "O5+fp8", "O5+kahan+int8+fp8:rowwise": what `variant` reads back."""
        return variant_label(self.level, self.master_weights, self.fp8, self.optimizer_states)


def _fp8_part(part: str, text: str, what: str) -> str | bool:
    """"fp8" -> True, "fp8:rowwise" -> "rowwise"; an unknown recipe raises ValueError naming them."""
    _, sep, recipe = part.partition(":")
    if not sep:
        return True
    recipe = recipe.strip().lower()
    if recipe not in FP8_RECIPES:
        raise ConfigError(f"{what} {text!r}: {recipe!r} is not an fp8 recipe; use one of "
                          f"{', '.join(map(repr, FP8_RECIPES))} (e.g. O5+fp8:rowwise), or O5+fp8 for tensorwise.")
    return recipe


def variant(text: Any, what: str = "level") -> Variant:
    """A level as the command line names it, with optional parts after '+': a low-memory master
    mode ("O5+kahan": master_weights="kahan", for the levels that cast the model: O2, O3, O5),
    the optimizer state's precision ("O5+int8", "O1+bfloat16": optimizer_states, any level)
    and FP8 ("O5+fp8": tensorwise, "O5+fp8:rowwise"), each at most once, in any order:
    "O5" -> Variant("O5"), " o5+Kahan+FP8:rowwise" -> Variant("O5", "kahan", "rowwise").
    Anything else raises ValueError naming what is accepted. Whether FP8 fits the level's half
    dtype is `options.check_fp8`'s to say, once the device is known."""
    if not isinstance(text, str):
        raise ConfigTypeError(f"{what} must be a string such as 'O5', 'O5+kahan' or 'O5+fp8', got "
                              f"{type(text).__name__}.")
    base, *parts = text.split(VARIANT)
    level = normalize(base, what)
    mode: str | None = None
    fp8: str | bool | None = None
    states: str | None = None
    for raw in parts:
        part = raw.strip().lower()
        if part.partition(":")[0].strip() == FP8_VARIANT:
            if fp8 is not None:
                raise ConfigError(f"{what} {text!r}: fp8 is given twice.")
            fp8 = _fp8_part(part, text, what)
            continue
        if part in STATE_PRECISIONS:
            if states is not None:
                raise ConfigError(f"{what} {text!r}: one optimizer_states precision at most.")
            states = part
            continue
        if part not in LOW_MEMORY_MODES:
            raise ConfigError(f"{what} {text!r}: after '+' comes a master_weights mode, one of "
                              f"{', '.join(LOW_MEMORY_MODES)} (e.g. O5+kahan), an optimizer_states precision, one of "
                              f"{', '.join(STATE_PRECISIONS)} (e.g. O5+int8), or fp8 with an optional recipe "
                              f"(O5+fp8, O5+fp8:rowwise; recipes: {', '.join(FP8_RECIPES)}).")
        if mode is not None:
            raise ConfigError(f"{what} {text!r}: one master_weights mode at most.")
        if level not in CASTING_LEVELS:
            raise ConfigError(f"{what} {text!r}: master_weights={part!r} applies to the levels that cast the model to "
                              f"bfloat16 ({', '.join(CASTING_LEVELS)}), not to {level}.")
        mode = part
    return Variant(level, mode, fp8, states)


def variant_label(level: str, mode: str | None = None, fp8: str | bool | None = None,
                  optimizer_states: str | None = None) -> str:
    """"O5", "O5+kahan", "O5+int8", "O5+fp8", "O5+fp8:rowwise": the inverse of `variant`."""
    label = level if mode is None else f"{level}{VARIANT}{mode}"
    if optimizer_states is not None:
        label += f"{VARIANT}{optimizer_states}"
    if fp8 is True:
        label += f"{VARIANT}{FP8_VARIANT}"
    elif fp8:
        label += f"{VARIANT}{FP8_VARIANT}:{fp8}"
    return label
