"""The values a setting may take, each parsed by one function: dtypes and their names, flags,
loss scales (with their range and defaults), master-weight modes, the precision of an
optimizer's state, FP8 recipes and layer choices, and comma-separated names.

`initialize`'s keywords, the ``AMPATCH_*`` variables, policy files and the command line all
parse through here, so "bfloat16", "True" or "dynamic" mean the same wherever they are
written, and a bad value fails with the same message naming the fix.
"""
from __future__ import annotations

import enum
import math
import sys
from typing import Any

import torch

from ..base.dtypes import FLOATS
from ..errors import BadFlagString, ConfigError, ConfigTypeError

__all__ = ["DYNAMIC", "USABLE_RANGE", "INITIAL_LOSS_SCALE", "DEFAULT_MIN_LOSS_SCALE", "DEFAULT_MAX_LOSS_SCALE",
           "BadFlagString", "MasterMode", "parse_dtype", "parse_bool", "parse_env_flag", "parse_loss_scale",
           "check_scale_value",
           "parse_master_weights", "StatePrecision", "STATE_PRECISIONS", "parse_optimizer_states", "parse_names",
           "FP8_RECIPES", "DEFAULT_FP8_RECIPE", "parse_fp8", "parse_fp8_modules", "is_fp8_config"]

DYNAMIC = "dynamic"
INITIAL_LOSS_SCALE = 2.0 ** 16       # where a dynamic scale starts (Apex's value)
DEFAULT_MIN_LOSS_SCALE = 2.0 ** -16  # the floor of a dynamic scale when min_loss_scale is None
DEFAULT_MAX_LOSS_SCALE = 2.0 ** 24   # the ceiling of a dynamic scale (initialize's max_loss_scale)
# Any scale (a static one, min_loss_scale, max_loss_scale) lies in this range: the scale and
# its inverse are finite, normal FP32 numbers.
USABLE_RANGE = (2.0 ** -126, 2.0 ** 126)

_DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16,
                "half": torch.float16, "bfloat16": torch.bfloat16}


def parse_dtype(value: Any, what: str) -> torch.dtype | None:
    """Accept a torch float dtype or its name ("bfloat16", "torch.float16"); None passes."""
    if value is None or isinstance(value, torch.dtype):
        if value is not None and value not in FLOATS:
            raise ConfigError(f"{what} must be torch.float32, torch.float16 or torch.bfloat16, got {value}.")
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
        raise ConfigError(f"{what}={value!r} is not a float dtype; use 'float32', 'float16' or 'bfloat16'.")
    raise ConfigTypeError(f"{what} must be a torch.dtype (e.g. torch.bfloat16) or None, got {type(value).__name__}.")


def parse_bool(value: Any, what: str) -> bool | None:
    """True/False/None, or Apex's string forms "True"/"False"."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if value in ("True", "False"):
            return value == "True"
        raise BadFlagString(f"{what}={value!r}: use True or False (or the strings 'True' / 'False').")
    raise ConfigTypeError(f"{what} must be True, False, 'True', 'False' or None, got {value!r}.")


def check_scale_value(value: object, name: str) -> float:
    """`value` as a float if it is a usable scale; else a ValueError/TypeError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigTypeError(f"{name} must be a number, got {value!r}.")
    value = float(value)
    low, high = USABLE_RANGE
    if not math.isfinite(value) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} is not a usable loss scale: use a finite number between 2**-126 and "
                          "2**126 (the scale and its inverse must be finite FP32 numbers); typical values are "
                          "1.0 to 2**24.")
    return value


def parse_loss_scale(value: Any) -> float | str | None:
    """A usable scale given as a number (numpy scalars and 0-dim tensors too, as float() took
    them in Apex) or a numeric string, or "dynamic"; None passes."""
    if value is None or value == DYNAMIC:
        return value
    if isinstance(value, bool):
        raise ConfigTypeError("loss_scale must be a number, a numeric string or 'dynamic', not a bool.")
    if isinstance(value, str):
        if value.strip() == DYNAMIC:
            return DYNAMIC
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"loss_scale={value!r}: use a number such as 128.0, or 'dynamic'.") from None
    else:
        try:
            value = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise ConfigTypeError(f"loss_scale must be a number or 'dynamic', got {type(value).__name__}.") from None
    return check_scale_value(value, "loss_scale")


class MasterMode(enum.Enum):
    """What keeps the exact weights a half model is stepped from (`master_weights`)."""

    NONE = "none"              # no masters: the half weights are stepped as they are (O3)
    FP32 = "fp32"              # FP32 master copies (O2, O5): +4 bytes per parameter
    STOCHASTIC = "stochastic"  # the bfloat16 weight alone, updates rounded stochastically: +0 bytes
    KAHAN = "kahan"            # the bfloat16 weight plus a bfloat16 compensation: +2 bytes

    @property
    def extra_bytes(self) -> int:
        """Bytes per parameter this mode keeps besides the half weight."""
        return {MasterMode.NONE: 0, MasterMode.FP32: 4, MasterMode.STOCHASTIC: 0, MasterMode.KAHAN: 2}[self]

    @property
    def low_memory(self) -> bool:
        """The modes that keep no FP32 copy but still learn (stochastic, kahan)."""
        return self in (MasterMode.STOCHASTIC, MasterMode.KAHAN)


LOW_MEMORY_MODES = tuple(m.value for m in MasterMode if m.low_memory)  # the string values


def parse_master_weights(value: Any) -> bool | str | None:
    """`master_weights`: True/False/None ("True"/"False" too, as Apex took them), or one of the
    low-memory modes "stochastic" / "kahan" (a bfloat16 model without FP32 masters)."""
    if isinstance(value, str) and value.strip().lower() in LOW_MEMORY_MODES:
        return value.strip().lower()
    if isinstance(value, str) and value not in ("True", "False"):
        raise BadFlagString(f"master_weights={value!r}: use True, False, 'stochastic' or 'kahan' (the last two "
                            "keep no FP32 copy of a bfloat16 model: O2/O3/O5 only).")
    return parse_bool(value, "master_weights")


class StatePrecision(enum.Enum):
    """What an optimizer's per-element state (Adam's moments, a momentum buffer) is stored in
    between steps (`optimizer_states`); the step itself always computes in FP32."""

    FLOAT32 = "float32"    # the optimizer's own state, as it makes it
    BFLOAT16 = "bfloat16"  # rounded stochastically on write: 2 bytes per element
    INT8 = "int8"          # 8-bit codes with an FP32 scale per block of 256: about 1 byte per element

    @property
    def stored(self) -> bool:
        """Whether ampatch keeps the state (else the optimizer keeps its own)."""
        return self is not StatePrecision.FLOAT32

    def __str__(self) -> str:
        return self.value


STATE_PRECISIONS = tuple(p.value for p in StatePrecision)
_STATE_DTYPES = {torch.float32: StatePrecision.FLOAT32, torch.bfloat16: StatePrecision.BFLOAT16,
                 torch.int8: StatePrecision.INT8}


def parse_optimizer_states(value: Any, what: str = "optimizer_states") -> StatePrecision:
    """`optimizer_states`: "float32" (the default, also None: the optimizer's own state),
    "bfloat16" or "int8" (any case; the torch dtypes of those names too)."""
    if value is None:
        return StatePrecision.FLOAT32
    if isinstance(value, StatePrecision):
        return value
    if isinstance(value, torch.dtype) and value in _STATE_DTYPES:
        return _STATE_DTYPES[value]
    choices = "'float32' (the optimizer's own state), 'bfloat16' or 'int8'"
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in STATE_PRECISIONS:
            return StatePrecision(key)
        raise ConfigError(f"{what}={value!r} is not a state precision; use {choices}.")
    raise ConfigTypeError(f"{what} must be {choices}, got {type(value).__name__}.")


def parse_names(text: str) -> list[str]:
    """"a, b,c" -> ["a", "b", "c"] (empty items dropped): the format of every comma-separated
    list (AMPATCH_KEEP_FP32, --keep-fp32, --levels, a policy file's keep_fp32 as a string)."""
    return [t.strip() for t in text.split(",") if t.strip()]


# torchao's float8 training recipes (`torchao.float8.Float8LinearRecipeName`, a test keeps them
# equal), written here so that parsing `fp8=` imports no torchao; True means the first.
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
DEFAULT_FP8_RECIPE = FP8_RECIPES[0]
# How the environment writes a flag (`AMPATCH_TIME_WRAPPERS`, `AMPATCH_FP8`): one reading for all of them
FLAG_ON, FLAG_OFF = ("true", "1", "on", "yes"), ("false", "0", "off", "no", "none", "")


def parse_env_flag(value: str | None) -> bool | None:
    """An environment variable read as a flag: True for 1/true/on/yes, False for
    0/false/off/no/none/empty (any case), None for anything else (the caller names what it
    accepts)."""
    key = (value or "").strip().lower()
    return True if key in FLAG_ON else False if key in FLAG_OFF else None


def is_fp8_config(value: Any) -> bool:
    """Whether `value` is a `torchao.float8.Float8LinearConfig` (without importing torchao:
    one exists only once torchao was imported)."""
    module = sys.modules.get("torchao.float8.config")
    cls = getattr(module, "Float8LinearConfig", None)
    return cls is not None and isinstance(value, cls)


def parse_fp8(value: Any, what: str = "fp8") -> Any:
    """`fp8`: None or False (off, returned as None), True (= "tensorwise"), a recipe name
    (any case; the strings "True"/"False"/"1"/"0"/"off" too, as the environment gives
    them), or a `torchao.float8.Float8LinearConfig` (returned as is)."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_FP8_RECIPE
    if is_fp8_config(value):
        return value
    recipes = ", ".join(map(repr, FP8_RECIPES))
    choices = (f"True, one of {recipes}, a torchao.float8.Float8LinearConfig, or None/False (off)" if what == "fp8"
               else f"one of {recipes}, 1 (tensorwise) or off")
    if isinstance(value, str):
        key = value.strip().lower()
        if key in FP8_RECIPES:
            return key
        flag = parse_env_flag(value)
        if flag is not None:
            return DEFAULT_FP8_RECIPE if flag else None
        raise ConfigError(f"{what + '=' if what else ''}{value!r} is not an fp8 recipe; use {choices}.")
    raise ConfigTypeError(f"{what} must be {choices}; got {type(value).__name__}.")


def parse_fp8_modules(value: Any) -> tuple[str, ...] | Any:
    """`fp8_modules`: layer names or glob patterns as `named_modules()` gives them ("a,b", or a
    list of them; returned as a tuple), a callable `(module, fqn) -> bool` (returned as is),
    or None (the default choice)."""
    if value is None:
        return None
    if isinstance(value, str):
        names = parse_names(value)
    elif isinstance(value, (list, tuple, set, frozenset)):
        if not all(isinstance(v, str) for v in value):
            others = sorted({type(v).__name__ for v in value if not isinstance(v, str)})
            raise ConfigTypeError("fp8_modules takes layer names or glob patterns ('blocks.*.mlp.*'), or one callable "
                                  f"(module, fqn) -> bool; got a list holding {others}.")
        names = [n for v in value for n in parse_names(v)]
    elif callable(value):
        return value
    else:
        raise ConfigTypeError(f"fp8_modules takes layer names or glob patterns, or a callable (module, fqn) -> bool; "
                              f"got {type(value).__name__}.")
    if not names:
        raise ConfigError("fp8_modules is empty: name the layers to run in FP8 (globs such as 'blocks.*' work), or "
                          "leave it None for the default choice (every Linear with dims multiples of 16 but the "
                          "output head).")
    return tuple(dict.fromkeys(names))
