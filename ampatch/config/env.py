"""Every environment variable ampatch reads, named once, and read once into `Overrides`.

The `ampatch` command talks to the runs it starts through these (a forced level, where to
write the report, live progress, ...); a user can set them by hand for the same effect.
Each name is read or written only through this module's constants, and read only by
`read()`: `initialize` takes one `Overrides` snapshot and hands it to what needs it, so a
bad value fails before anything changes, with a message naming the variable.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..errors import ConfigError, reason
from . import levels
from .values import (
    StatePrecision,
    parse_dtype,
    parse_env_flag,
    parse_fp8,
    parse_loss_scale,
    parse_master_weights,
    parse_names,
    parse_optimizer_states,
)

__all__ = ["OPT_LEVEL", "HALF_DTYPE", "KEEP_FP32", "LOSS_SCALE", "MASTER_WEIGHTS", "MAX_STEPS", "REPORT", "PROGRESS",
           "TIME_WRAPPERS", "DIAGNOSE", "POLICY", "FP8", "FP8_MODULES", "OPTIMIZER_STATES", "WITNESS", "ALL",
           "Overrides", "NO_OVERRIDES", "read", "without_ampatch"]

OPT_LEVEL = "AMPATCH_OPT_LEVEL"          # force every initialize to this level
HALF_DTYPE = "AMPATCH_HALF_DTYPE"        # force the half dtype of O1-O3 (float16/bfloat16)
KEEP_FP32 = "AMPATCH_KEEP_FP32"          # modules to keep in FP32, comma-separated names
LOSS_SCALE = "AMPATCH_LOSS_SCALE"        # force the loss scale: a number or "dynamic"
MASTER_WEIGHTS = "AMPATCH_MASTER_WEIGHTS"  # force master_weights: True/False/stochastic/kahan
MAX_STEPS = "AMPATCH_MAX_STEPS"          # end the process after this many optimizer steps
REPORT = "AMPATCH_REPORT"                # write the session's report() as JSON here at exit
PROGRESS = "AMPATCH_PROGRESS"            # append "step loss" lines here while recording
TIME_WRAPPERS = "AMPATCH_TIME_WRAPPERS"  # "1": time every O1 wrapper's own work
DIAGNOSE = "AMPATCH_DIAGNOSE"            # write per-module precision statistics here at exit
POLICY = "AMPATCH_POLICY"                # apply this policy file (ampatch tune's) to every initialize
FP8 = "AMPATCH_FP8"                      # force fp8: a recipe name, 1/true (tensorwise) or 0/off
FP8_MODULES = "AMPATCH_FP8_MODULES"      # force fp8_modules: the layers run in FP8, comma-separated names/globs
OPTIMIZER_STATES = "AMPATCH_OPTIMIZER_STATES"  # force optimizer_states: float32, bfloat16 or int8
WITNESS = "AMPATCH_WITNESS"              # write a projection of the stepped weights here at exit (session.witness)

ALL = (OPT_LEVEL, HALF_DTYPE, KEEP_FP32, LOSS_SCALE, MASTER_WEIGHTS, MAX_STEPS, REPORT, PROGRESS, TIME_WRAPPERS,
       DIAGNOSE, POLICY, FP8, FP8_MODULES, OPTIMIZER_STATES, WITNESS)
PREFIX = "AMPATCH_"


@dataclass(frozen=True)
class Overrides:
    """What the environment asks of a session, parsed and checked (all unset: `Overrides()`).

    `raw` keeps each set variable's text, so that messages quote what the user wrote."""

    opt_level: str | None = None             # AMPATCH_OPT_LEVEL, upper-cased
    half_dtype: torch.dtype | None = None    # AMPATCH_HALF_DTYPE
    keep_fp32: tuple[str, ...] = ()          # AMPATCH_KEEP_FP32
    loss_scale: float | str | None = None    # AMPATCH_LOSS_SCALE: a scale or "dynamic"
    master_weights: bool | str | None = None  # AMPATCH_MASTER_WEIGHTS: True/False, "stochastic", "kahan"
    max_steps: int | None = None             # AMPATCH_MAX_STEPS
    report: str | None = None                # AMPATCH_REPORT
    progress: str | None = None              # AMPATCH_PROGRESS (only while recording a report)
    time_wrappers: bool = False              # AMPATCH_TIME_WRAPPERS
    diagnose: str | None = None              # AMPATCH_DIAGNOSE
    policy: str | None = None                # AMPATCH_POLICY: a policy file's path (see policy_file.from_outside)
    fp8: str | bool | None = None            # AMPATCH_FP8: a recipe name, or False (forced off)
    fp8_modules: tuple[str, ...] | None = None  # AMPATCH_FP8_MODULES: layer names or globs (None: unset)
    optimizer_states: StatePrecision | None = None  # AMPATCH_OPTIMIZER_STATES
    witness: str | None = None               # AMPATCH_WITNESS (only while recording a report)
    raw: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    # field -> how messages name where its value came from, when not its own variable (a policy file)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    # a keep_fp32 name -> where it came from, when not AMPATCH_KEEP_FP32 (a policy file's keep_fp32)
    keep_fp32_sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def keep_source(self, name: str) -> str:
        """Where the forced keep_fp32 `name` came from, as messages name it."""
        return self.keep_fp32_sources.get(name, KEEP_FP32)

    VARIABLES: ClassVar[dict[str, str]] = {
        "opt_level": OPT_LEVEL, "half_dtype": HALF_DTYPE, "keep_fp32": KEEP_FP32, "loss_scale": LOSS_SCALE,
        "master_weights": MASTER_WEIGHTS,
        "max_steps": MAX_STEPS, "report": REPORT, "progress": PROGRESS, "time_wrappers": TIME_WRAPPERS,
        "diagnose": DIAGNOSE, "policy": POLICY, "fp8": FP8,
        "fp8_modules": FP8_MODULES, "optimizer_states": OPTIMIZER_STATES, "witness": WITNESS}

    def quote(self, field_name: str) -> str:
        """"AMPATCH_X=value" for a field, as the user set it: what messages quote."""
        if field_name in self.sources:
            return self.sources[field_name]
        name = self.VARIABLES[field_name]
        return f"{name}={self.raw.get(name, '')}"


NO_OVERRIDES = Overrides()  # nothing asked from outside (the default where no environment was read)


def _value(environ: Mapping[str, str], name: str) -> str | None:
    return environ.get(name) or None  # unset or empty: not given


def _positive_int(name: str, value: str | None) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ConfigError(f"{name}={value!r}: expected a positive integer (or leave it unset).")
    return int(value)


def _checked(name: str, value: str | None, parse):
    """`parse(value)`, its ValueError/TypeError re-raised as a ValueError naming the variable."""
    if value is None:
        return None
    try:
        return parse(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name}={value!r}: {reason(exc)}") from None


def _level(value: str) -> str:
    try:
        return levels.normalize(value)
    except ValueError:
        raise ConfigError(f"not an opt level; use one of {', '.join(levels.LEVELS)}.") from None


def _half(value: str | None) -> torch.dtype | None:
    half = parse_dtype(value.strip(), HALF_DTYPE) if value is not None else None  # its message names it
    if half == torch.float32:
        raise ConfigError(f"{HALF_DTYPE}={value!r} is not a half type: use float16 or bfloat16 (or force "
                          f"{OPT_LEVEL}=O0 for FP32).")
    return half


def _flag(value: str) -> bool:
    flag = parse_env_flag(value)
    if flag is None:
        raise ConfigError("is not a flag: use 1/true/on/yes or 0/false/off/no.")
    return flag


def _layer_names(value: str) -> tuple[str, ...]:
    names = tuple(parse_names(value))
    if not names:
        raise ConfigError("names no layer: give layer names or globs as named_modules() gives them "
                          "('blocks.0.mlp.fc1,blocks.*.attn.*'), or leave it unset.")
    return names


def read(environ: Mapping[str, str] | None = None) -> Overrides:
    """The overrides in `environ` (default: this process's environment), checked: a bad value
    raises `ValueError` naming the variable and what it accepts."""
    source = os.environ if environ is None else environ
    v = {name: _value(source, name) for name in ALL}
    return Overrides(
        opt_level=_checked(OPT_LEVEL, v[OPT_LEVEL], _level),
        half_dtype=_half(v[HALF_DTYPE]),
        keep_fp32=tuple(parse_names(v[KEEP_FP32] or "")),
        loss_scale=_checked(LOSS_SCALE, v[LOSS_SCALE], lambda s: parse_loss_scale(s.strip())),
        master_weights=_checked(MASTER_WEIGHTS, v[MASTER_WEIGHTS], lambda s: parse_master_weights(s.strip())),
        max_steps=_positive_int(MAX_STEPS, v[MAX_STEPS]),
        report=v[REPORT],
        progress=v[PROGRESS] if v[REPORT] else None,
        time_wrappers=_checked(TIME_WRAPPERS, v[TIME_WRAPPERS], _flag) or False,
        diagnose=v[DIAGNOSE],
        policy=v[POLICY],
        fp8=_checked(FP8, v[FP8], lambda s: parse_fp8(s, "") or False),
        fp8_modules=_checked(FP8_MODULES, v[FP8_MODULES], _layer_names),
        optimizer_states=_checked(OPTIMIZER_STATES, v[OPTIMIZER_STATES], parse_optimizer_states),
        witness=v[WITNESS] if v[REPORT] else None,
        raw={name: value for name, value in v.items() if value is not None},
    )


def without_ampatch(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `environ` (default: this process's) with no AMPATCH_* variable."""
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if not k.startswith(PREFIX)}
