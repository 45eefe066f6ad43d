"""What a session is asked to be, and what it resolves to.

`Options`: `initialize`'s keywords, made once per call and handed on whole (like minGPT's
config), each field parsed and checked on creation (a dtype, a bool, a float scale, a
normalized level), so nothing downstream parses again. `resolve(options, device, overrides)`
checks them as a whole against the level table, the device and the environment, and gives
the session's `Properties`; settings from outside (`env.Overrides`: ``AMPATCH_OPT_LEVEL`` and
the rest, or a policy file through ``AMPATCH_POLICY``) beat the script by one rule, written
once in `_outside_wins`. Property values mean what they meant in Apex (`frontend.py`); the
overrides Apex refused raise `OverrideError` (a warning with `hard_override`). All of it
runs before anything changes. A policy given as `policy=` is applied to the keywords first
(`session.prepare.takes_policy`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..base.dtypes import LOW, short_name
from ..base.notices import warn
from ..errors import ConfigError, ConfigTypeError, OverrideError, PlatformError, reason
from . import levels
from .env import NO_OVERRIDES, Overrides
from .settings import SETTINGS
from .values import (
    DEFAULT_MAX_LOSS_SCALE,
    DYNAMIC,
    MasterMode,
    StatePrecision,
    check_scale_value,
    parse_bool,
    parse_dtype,
    parse_fp8,
    parse_fp8_modules,
    parse_loss_scale,
    parse_master_weights,
    parse_optimizer_states,
)

__all__ = ["Options", "OverrideError", "warn_or_err", "NO_CAST", "PROPERTY_KEYWORDS", "Properties", "resolve",
           "OUTSIDE", "check_fp8", "fp8_conflict"]

NO_CAST = "no cast"  # cast_model_type=False: Apex's "leave the model as it is", at any level
# The keywords that override a level's defaults (Apex's `amp` properties); None: the level's own.
PROPERTY_KEYWORDS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
                     "loss_scale")


def warn_or_err(message: str, hard_override: bool = False) -> None:
    """Apex's rule: raise, unless the user asked for `_amp_state.hard_override = True`."""
    if not hard_override:
        raise OverrideError(message)
    warn(f"ampatch: hard_override: {message}")


@dataclass(frozen=True)
class Options:
    """The keywords of `ampatch.initialize`: same names, same defaults, same order (a test
    keeps them equal), `models`, `optimizers` and `policy` aside. Parsed on creation:
    `opt_level` normalized ("o2 " -> "O2"), dtypes as `torch.dtype`, Apex's string flags as
    bools, `loss_scale` a float or "dynamic", `cast_model_type=False` as `NO_CAST`,
    `half_dtype` taking `patch_torch_functions_type` (its ROCm Apex alias), `fp8` None or a
    recipe name or a torchao config (`values.parse_fp8`), `fp8_modules` a tuple of names or
    globs or a callable, `optimizer_states` a `StatePrecision`."""

    enabled: bool = True
    opt_level: str = "O1"
    cast_model_type: Any = None
    patch_torch_functions: Any = None
    keep_batchnorm_fp32: Any = None
    master_weights: Any = None
    loss_scale: Any = None
    cast_model_outputs: Any = None
    num_losses: int = 1
    verbosity: int = 1
    min_loss_scale: float | None = None
    max_loss_scale: float = DEFAULT_MAX_LOSS_SCALE
    half_dtype: Any = None
    allow_banned: bool = False
    patch_torch_functions_type: Any = None
    process_group: Any = None
    keep_fp32: Any = None
    fp8: Any = None
    fp8_modules: Any = None
    optimizer_states: Any = "float32"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.enabled, bool):
            raise ConfigTypeError(f"enabled must be True or False, got {self.enabled!r}.")
        try:
            put("opt_level", levels.normalize(self.opt_level))
        except ValueError as exc:  # Apex raised RuntimeError for an unknown level
            raise OverrideError(str(exc)) from None
        cmt = self.cast_model_type
        put("cast_model_type", NO_CAST if cmt is False or cmt == NO_CAST else parse_dtype(cmt, "cast_model_type"))
        put("patch_torch_functions", parse_bool(self.patch_torch_functions, "patch_torch_functions"))
        put("keep_batchnorm_fp32", parse_bool(self.keep_batchnorm_fp32, "keep_batchnorm_fp32"))
        put("master_weights", parse_master_weights(self.master_weights))
        put("loss_scale", parse_loss_scale(self.loss_scale))
        put("cast_model_outputs", parse_dtype(self.cast_model_outputs, "cast_model_outputs"))
        half = parse_dtype(self.half_dtype, "half_dtype")
        alias = parse_dtype(self.patch_torch_functions_type, "patch_torch_functions_type")
        if alias is not None:
            if half is not None and half != alias:
                raise ConfigError("half_dtype and patch_torch_functions_type (its ROCm Apex alias) disagree; pass one.")
            half = alias
        if half == torch.float32:
            raise ConfigError("half_dtype=torch.float32 is not a half type; use opt_level='O0' for FP32.")
        put("half_dtype", half)
        if not isinstance(self.num_losses, int) or isinstance(self.num_losses, bool) or self.num_losses < 1:
            raise ConfigError(f"num_losses must be a positive int, got {self.num_losses!r}.")
        if not isinstance(self.verbosity, int):
            raise ConfigTypeError(f"verbosity must be an int (0 silences ampatch), got {self.verbosity!r}.")
        low = None if self.min_loss_scale is None else check_scale_value(self.min_loss_scale, "min_loss_scale")
        high = float(check_scale_value(self.max_loss_scale, "max_loss_scale"))
        if low is not None and low > high:
            raise ConfigError(f"min_loss_scale={low} exceeds max_loss_scale={high}.")
        put("min_loss_scale", low)
        put("max_loss_scale", high)
        if not isinstance(self.allow_banned, bool):
            raise ConfigTypeError(f"allow_banned must be True or False, got {self.allow_banned!r}.")
        _check_process_group(self.process_group)
        put("fp8", parse_fp8(self.fp8))
        put("fp8_modules", parse_fp8_modules(self.fp8_modules))
        if self.fp8_modules is not None and self.fp8 is None:
            raise ConfigError("fp8_modules chooses the layers that run in FP8, but fp8 is off: pass fp8=True (or a "
                              "recipe name such as 'rowwise') with it, or drop fp8_modules.")
        put("optimizer_states", parse_optimizer_states(self.optimizer_states))

    def given(self) -> dict[str, Any]:
        """The property keywords that were given (not None), in the signature's order."""
        return {name: getattr(self, name) for name in PROPERTY_KEYWORDS if getattr(self, name) is not None}

    def replace(self, **changes: Any) -> Options:
        """A copy with `changes` (parsed like the rest)."""
        return dataclasses.replace(self, **changes)


# what the environment may force; the values that mean the script left one unset
UNSET = {"optimizer_states": StatePrecision.FLOAT32}
OUTSIDE = ("opt_level", "half_dtype", "loss_scale", "master_weights", "fp8", "fp8_modules", "optimizer_states")


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
    fp8: Any = None  # None: off; a recipe name (values.FP8_RECIPES) or a torchao Float8LinearConfig
    fp8_modules: Any = None  # with fp8: the layers (names/globs, a callable; None: the default choice)
    optimizer_states: StatePrecision = StatePrecision.FLOAT32  # what the optimizers' state is stored in

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


def resolve(options: Options, device: torch.device | None = None, overrides: Overrides = NO_OVERRIDES,
            hard_override: bool | None = None) -> tuple[Properties, list[str]]:
    """The session's `Properties` for `options` on `device`, and the notes to log about what
    the environment changed. `hard_override`: Apex's flag (None: `SETTINGS.hard_override`).

    Without a forced level, an override Apex refused raises `OverrideError`. A forced level
    (from outside) wins instead, and each of the script's keywords that conflicts with it is
    dropped, with a note."""
    notes: list[str] = []
    hard = SETTINGS.hard_override if hard_override is None else hard_override
    forced = overrides.opt_level is not None
    if overrides.opt_level is not None and levels.half_dtype_conflict(overrides.opt_level, options.half_dtype):
        notes.append(f"ampatch: dropping half_dtype={options.half_dtype}, which conflicts with forced "
                     f"{overrides.opt_level}.")
        options = options.replace(half_dtype=None)
    scripts_fp8 = options.fp8 is not None and overrides.fp8 is None
    options = _outside_wins(options, overrides, notes)
    why = _fp8_conflict(options.replace(enabled=True, **dict.fromkeys(options.given())), device) \
        if forced and scripts_fp8 else None
    if why:
        notes.append(f"ampatch: dropping fp8={options.fp8!r}, which conflicts with forced {options.opt_level} ({why})")
        options = options.replace(fp8=None, fp8_modules=None)
    if not forced:
        return _build(options, device, hard), notes
    kept = options.replace(enabled=True, **dict.fromkeys(options.given()))  # a forced level runs, even disabled
    for name, value in options.given().items():
        trial = kept.replace(**{name: value})
        try:
            _build(trial, device, False)
        except ValueError as err:
            notes.append(f"ampatch: dropping {name}={False if value is NO_CAST else value!r}, which conflicts "
                         f"with forced {options.opt_level} ({reason(err)})")
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
        if name == "fp8" and value is False:  # AMPATCH_FP8=0: forced off
            if options.fp8 is not None:
                notes.append(f"ampatch: {overrides.quote(name)} turns off the script's fp8={options.fp8!r}.")
            changes.update(fp8=None, fp8_modules=None)
            continue
        if name == "fp8_modules" and changes.get("fp8", options.fp8) is None:  # "fp8" comes first in OUTSIDE
            notes.append(f"ampatch: {overrides.quote(name)} ignored: fp8 is off (set AMPATCH_FP8 with it).")
            changes["fp8_modules"] = None
            continue
        if name == "half_dtype" and levels.half_dtype_conflict(level, value):
            notes.append(f"ampatch: {overrides.quote(name)} does not apply to {level}, which always runs in "
                         "bfloat16; ignored.")
            continue
        mine = getattr(options, name)
        if mine not in (None, UNSET.get(name)) and mine != value:
            notes.append(f"ampatch: {overrides.quote(name)} overrides the script's {name}={mine}.")
        changes[name] = value
    return options.replace(**changes) if changes else options


def _build(options: Options, device: Any, hard_override: bool) -> Properties:
    """The level's defaults with the keywords given, checked as a whole."""
    level, half, given = options.opt_level, options.half_dtype, options.given()
    conflict = levels.half_dtype_conflict(level, half)
    if conflict:
        raise ConfigError(conflict)
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
    if options.fp8 is not None:
        runs_half = merged["patch_torch_functions"] or cast not in (None, NO_CAST, torch.float32)
        computes = half if runs_half else torch.float32
        check_fp8(level, options.fp8, computes)
    return Properties(
        enabled=options.enabled, opt_level=level, half_dtype=half,
        cast_model_type=None if cast is NO_CAST else cast,  # NO_CAST: the model stays as it came in
        patch_torch_functions=bool(merged["patch_torch_functions"]),
        keep_batchnorm_fp32=merged["keep_batchnorm_fp32"], master_weights=merged["master_weights"],
        loss_scale=merged["loss_scale"], cast_model_outputs=options.cast_model_outputs,
        fp8=options.fp8 if options.enabled else None,
        fp8_modules=options.fp8_modules if options.enabled and options.fp8 is not None else None,
        optimizer_states=options.optimizer_states if options.enabled else StatePrecision.FLOAT32)


def _fp8_conflict(options: Options, device: Any) -> str | None:
    """Why `options.fp8` cannot run with the rest of `options` (None: it can)."""
    try:
        _build(options, device, True)
    except ValueError as err:
        return reason(err)
    return None


def fp8_conflict(level: str, fp8: Any, half_dtype: Any = None, device: Any = None) -> str | None:
    """Why `fp8` cannot run at `level` with `half_dtype` (a dtype or its name; None or "auto":
    the device's own) on `device`: `initialize`'s refusal, word for word (None: it can). What
    the command line checks for `--levels O2+fp8` before any run starts."""
    half = None if half_dtype in (None, "auto") else half_dtype
    return _fp8_conflict(Options(opt_level=level, half_dtype=half, fp8=fp8), device)


def check_fp8(level: str, fp8: Any, computes: torch.dtype) -> None:
    """`fp8` runs where the converted layers compute in bfloat16 or FP32, as torchao's float8
    training supports: O0, O4, O5, and O1/O2/O3 with bfloat16."""
    if computes in (torch.bfloat16, torch.float32):
        return
    raise ConfigError(f"fp8={fp8!r} runs where the layers compute in bfloat16 or FP32 (torchao's float8 training), but "
                      f"{level} here computes in {short_name(computes)}. Use opt_level='O4' or 'O5' (bfloat16), or "
                      f"pass half_dtype=torch.bfloat16 with {level} (or O0 for FP32), or leave fp8 off.")


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
        raise ConfigError(f"cast_model_type={cmt} conflicts with half_dtype={half}; pass only one of them.")


def _check_low_memory(level: str, mode: str, model_dtype: torch.dtype | None) -> None:
    """master_weights="stochastic"/"kahan": a bfloat16 model (O2, O3, O5) stepped without FP32
    copies. Anywhere else there is nothing for them to do, and float16's narrow range would
    turn small updates into zeros or overflows that no loss scale covers: refused."""
    what = f"master_weights={mode!r}"
    if model_dtype is None:
        raise ConfigError(f"{what} applies where the model itself is cast to bfloat16 (O2, O3, O5), not to {level}, "
                          "whose model stays FP32. Use opt_level='O5' (or 'O2'/'O3' with half_dtype=torch.bfloat16) "
                          f"with {what}, or leave master_weights unset at {level}.")
    if model_dtype != torch.bfloat16:
        raise ConfigError(f"{what} needs a bfloat16 model, but {level} here casts it to {short_name(model_dtype)}: "
                          "float16 has too few exponent bits for updates kept without FP32 masters (they "
                          "underflow, and no loss scale reaches the optimizer's step), so ampatch refuses rather "
                          f"than scale. Use opt_level='O5' (or half_dtype=torch.bfloat16) with {what}, or "
                          "master_weights=True for float16.")


def _check_process_group(group: Any) -> None:
    """`process_group` is None (the world) or a torch.distributed group this rank belongs to."""
    if group is None:
        return
    if not torch.distributed.is_available():
        raise PlatformError("process_group was given, but this torch build has no torch.distributed.")
    if isinstance(group, int) and group == torch.distributed.GroupMember.NON_GROUP_MEMBER:
        raise ConfigError("process_group: this rank is not a member of that group (torch.distributed.new_group "
                          "returned NON_GROUP_MEMBER here); pass a group that contains this rank, or None.")
    if not isinstance(group, torch.distributed.ProcessGroup):
        raise ConfigTypeError(f"process_group must be a torch.distributed process group (from "
                              f"torch.distributed.new_group) or None for the world, got {type(group).__name__}.")
