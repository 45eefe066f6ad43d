"""A precision policy as a file: what `ampatch tune` chose, in a form training code reads.

A policy file is JSON with the fields of `amp.initialize` that a policy decides, and what
they were measured on::

    {"format": 1, "opt_level": "O1", "half_dtype": "bfloat16", "keep_fp32": ["head"],
     "loss_scale": null, "master_weights": null, "fp8": null, "fp8_modules": null,
     "optimizer_states": null,
     "measured": {"tolerance": 0.02, "steps": 60, "speedup": 1.41, "deviation": 0.004,
                  "machine": {"type": "cpu", "name": "...", "native": {"bfloat16": true, ...}},
                  "torch": "2.13.0", "what": "built-in workload lm (small)", "date": "..."}}

``half_dtype`` is null at O0 (FP32); ``loss_scale`` and ``master_weights`` null mean the
level's default (or the script's own); ``fp8`` is null (the script's own), false (off) or a
torchao recipe name ("tensorwise", "rowwise", "rowwise_with_gw_hp"), as ``AMPATCH_FP8``;
``fp8_modules`` null (the default choice of layers, or the script's own) or the list of layers that
run in FP8 (what ``tune`` writes once ``diagnose`` named layers FP8 hurts), as
``AMPATCH_FP8_MODULES``; ``optimizer_states`` null (the script's own) or "float32", "bfloat16",
"int8", as ``AMPATCH_OPTIMIZER_STATES``. It is applied two ways:

- in code, ``amp.initialize(..., policy="ampatch-policy.json")`` (a path or a dict;
  `session.prepare.takes_policy`, `apply_in_code`): a keyword the call gives explicitly beats the file's
  field, with a warning when they disagree;
- from outside, ``AMPATCH_POLICY=path`` (what ``ampatch run --policy`` and ``ampatch compare
  --policy`` set) for an unmodified script (`from_outside`): the file's fields act as
  ``AMPATCH_OPT_LEVEL``, ``AMPATCH_HALF_DTYPE``, ``AMPATCH_LOSS_SCALE``, ``AMPATCH_FP8``,
  ``AMPATCH_FP8_MODULES``, ``AMPATCH_OPTIMIZER_STATES`` and
  ``AMPATCH_KEEP_FP32`` would, by the one rule of settings from outside
  (`options.resolve`): its level wins, and each of the script's keywords that conflicts
  with it is dropped, with a warning. Its ``keep_fp32`` is added to the script's own (as
  ``tune`` measured it); those variables, when set as well, still win.

Where it is applied (`session.prepare.outside`), a policy measured on another kind of machine (another
device type, or its half dtype native there and emulated here) warns: its speed-up will not
hold here (`machine.hardware.policy_warning`).
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..base.dtypes import HALF_NAMES
from ..base.notices import warn
from ..errors import PolicyError, reason
from . import env, levels
from .values import parse_dtype, parse_fp8, parse_loss_scale, parse_master_weights, parse_names, parse_optimizer_states

__all__ = ["Policy", "PolicyError", "FORMAT", "FIELDS", "load", "save", "apply_in_code", "from_outside",
           "DEFAULT_PATH"]

FORMAT = 1
DEFAULT_PATH = "ampatch-policy.json"
# the initialize keywords it sets
FIELDS = ("opt_level", "half_dtype", "keep_fp32", "loss_scale", "master_weights", "fp8", "fp8_modules",
          "optimizer_states")
KEYS = ("format", *FIELDS, "measured")                             # every key a policy file may have


@dataclass(frozen=True)
class Policy:
    """One precision policy: the `initialize` keywords it sets, and what it was measured on
    (`measured`: tolerance, steps, speedup, deviation, machine, torch; None when written by hand)."""

    opt_level: str
    half_dtype: str | None = None
    keep_fp32: tuple[str, ...] = ()
    loss_scale: float | str | None = None
    master_weights: bool | str | None = None  # None: the level's own (True at O2/O5); "stochastic"/"kahan"
    fp8: str | bool | None = None  # None: the script's own; False: off; a recipe name (values.FP8_RECIPES)
    fp8_modules: tuple[str, ...] | None = None  # None: the default choice (or the script's own); the layers in FP8
    optimizer_states: str | None = None  # None: the script's own; "float32", "bfloat16" or "int8"
    measured: Mapping[str, Any] | None = field(default=None, compare=False, hash=False, kw_only=True)

    def keywords(self) -> dict[str, Any]:
        """The `initialize` keywords this policy sets (a field left null sets nothing)."""
        out: dict[str, Any] = {"opt_level": self.opt_level}
        if levels.half_name(self.opt_level, self.half_dtype) is not None:
            out["half_dtype"] = self.half_dtype
        if self.keep_fp32:
            out["keep_fp32"] = list(self.keep_fp32)
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        if self.master_weights is not None:
            out["master_weights"] = self.master_weights
        if self.fp8 is not None:
            out["fp8"] = self.fp8
        if self.fp8_modules is not None:
            out["fp8_modules"] = list(self.fp8_modules)
        if self.optimizer_states is not None:
            out["optimizer_states"] = self.optimizer_states
        return out

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON."""
        return {"format": FORMAT, "opt_level": self.opt_level, "half_dtype": self.half_dtype,
                "keep_fp32": list(self.keep_fp32), "loss_scale": self.loss_scale,
                "master_weights": self.master_weights, "fp8": self.fp8,
                "fp8_modules": list(self.fp8_modules) if self.fp8_modules is not None else None,
                "optimizer_states": self.optimizer_states,
                "measured": dict(self.measured) if self.measured is not None else None}

    def describe(self) -> str:
        """One short line: "O1 bfloat16, keep_fp32=['head'], loss_scale='dynamic'"."""
        half = levels.half_name(self.opt_level, self.half_dtype)
        text = self.opt_level + (f" {half}" if half else "")
        if self.keep_fp32:
            text += f", keep_fp32={list(self.keep_fp32)}"
        if self.loss_scale is not None:
            text += f", loss_scale={self.loss_scale!r}"
        if self.master_weights is not None:
            text += f", master_weights={self.master_weights!r}"
        if self.fp8:
            text += f", fp8={self.fp8!r}"
        if self.fp8_modules is not None:
            text += f", fp8_modules={list(self.fp8_modules)}"
        if self.optimizer_states is not None:
            text += f", optimizer_states={self.optimizer_states!r}"
        return text


def _check(data: Mapping[str, Any], where: str) -> Policy:
    """A `Policy` from a file's (or a dict's) content, every key and value checked."""
    if not isinstance(data, Mapping):
        raise PolicyError(f"{where}: a policy is a JSON object with {', '.join(FIELDS)}; got {type(data).__name__}.")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise PolicyError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; a policy has "
                          f"{', '.join(KEYS)}.")
    if data.get("format", FORMAT) != FORMAT:
        raise PolicyError(f"{where}: format {data.get('format')!r}; this ampatch reads format {FORMAT}.")
    try:
        level = levels.normalize(data.get("opt_level"))
    except (TypeError, ValueError):
        raise PolicyError(f"{where}: opt_level must be one of {', '.join(levels.LEVELS)}, got "
                          f"{data.get('opt_level')!r}.") from None
    half = data.get("half_dtype")
    if half is not None and half not in HALF_NAMES:
        raise PolicyError(f"{where}: half_dtype must be null or one of {', '.join(map(repr, HALF_NAMES))}, got "
                          f"{half!r}.")
    conflict = levels.half_dtype_conflict(level, half)
    if conflict:
        raise PolicyError(f"{where}: {conflict}")
    keep = data.get("keep_fp32") or []
    if isinstance(keep, str):
        keep = parse_names(keep)
    if not isinstance(keep, list) or not all(isinstance(k, str) and k.strip() for k in keep):
        raise PolicyError(f"{where}: keep_fp32 must be a list of module names (as named_modules() gives them), "
                          f"got {keep!r}.")
    scale = data.get("loss_scale")
    if scale is not None:
        try:
            scale = parse_loss_scale(scale)
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"{where}: loss_scale: {reason(exc)}") from None
    try:
        masters = parse_master_weights(data.get("master_weights"))
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"{where}: {reason(exc)}") from None
    fp8 = data.get("fp8")
    if fp8 is not None:
        if fp8 is not False and not isinstance(fp8, (str, bool)):
            raise PolicyError(f"{where}: fp8 must be null, false, true or a recipe name, got {fp8!r}.")
        try:
            fp8 = parse_fp8(fp8) or False
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"{where}: {reason(exc)}") from None
    layers = data.get("fp8_modules")
    if layers is not None:
        if isinstance(layers, str):
            layers = parse_names(layers)
        if not isinstance(layers, list) or not layers or not all(isinstance(k, str) and k.strip() for k in layers):
            raise PolicyError(f"{where}: fp8_modules must be null or a non-empty list of layer names or globs (as "
                              f"named_modules() gives them), got {layers!r}.")
        if fp8 is False:
            raise PolicyError(f"{where}: fp8_modules names the layers that run in FP8, but fp8 is false (off): "
                              "drop one of them.")
        layers = tuple(k.strip() for k in layers)
    states = data.get("optimizer_states")
    if states is not None:
        try:
            states = parse_optimizer_states(states).value
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"{where}: {reason(exc)}") from None
    measured = data.get("measured")
    if measured is not None and not isinstance(measured, Mapping):
        raise PolicyError(f"{where}: measured must be an object (or null), got {type(measured).__name__}.")
    return Policy(level, levels.half_name(level, half), tuple(k.strip() for k in keep), scale, masters, fp8, layers,
                  states, measured=dict(measured) if measured is not None else None)


def load(source: str | os.PathLike | Mapping[str, Any] | Policy) -> Policy:
    """The policy in a file (a path), a dict, or a `Policy` (returned as is). Raises
    `PolicyError` naming a missing file, unreadable JSON, an unknown key or a bad value."""
    if isinstance(source, Policy):
        return source
    if isinstance(source, Mapping):
        return _check(source, "policy")
    if not isinstance(source, (str, os.PathLike)):
        raise PolicyError(f"policy must be a path to a policy file or a dict, got {type(source).__name__}.")
    path = Path(source)
    if not path.is_file():
        raise PolicyError(f"policy file {str(path)!r} not found (write one with `ampatch tune --out {path}`).")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"policy file {str(path)!r} cannot be read: {exc}") from None
    except ValueError as exc:
        raise PolicyError(f"policy file {str(path)!r} is not valid JSON: {exc}") from None
    return _check(data, f"policy file {str(path)!r}")


def save(policy: Policy, path: str | os.PathLike) -> None:
    """Write `policy` as a policy file."""
    Path(path).write_text(json.dumps(policy.to_dict(), indent=1) + "\n")


def apply_in_code(keywords: dict[str, Any], policy: Any, explicit: Collection[str]) -> dict[str, Any]:
    """`initialize`'s keywords with `policy=` (a path, a dict, a `Policy`; None: none) applied
    in code: a keyword the call gave (`explicit`) beats the policy's field, with a warning when
    they disagree. Returns a new dict; raises `PolicyError` for a bad policy."""
    if policy is None:
        return dict(keywords)
    pol = load(policy)
    verbosity = keywords.get("verbosity", 1)
    out = dict(keywords)
    for name, value in pol.keywords().items():
        if name in explicit:
            if out.get(name) != value:
                warn(f"ampatch: initialize's {name}={out.get(name)!r} beats the policy's {name}={value!r}.",
                     verbosity)
            continue
        out[name] = value
    return out


def from_outside(overrides: env.Overrides) -> env.Overrides:
    """`overrides` with the policy file ``AMPATCH_POLICY`` names merged in, as if its fields
    were set as ``AMPATCH_OPT_LEVEL``, ``AMPATCH_HALF_DTYPE``, ``AMPATCH_LOSS_SCALE``,
    ``AMPATCH_MASTER_WEIGHTS``, ``AMPATCH_FP8``, ``AMPATCH_FP8_MODULES`` and
    ``AMPATCH_OPTIMIZER_STATES`` (which, when set
    too, still win; its ``keep_fp32`` is added to ``AMPATCH_KEEP_FP32``'s): from outside, a
    policy beats the script by the same rule as those variables (`options.resolve`). Raises
    `PolicyError` for a missing or bad file."""
    if overrides.policy is None:
        return overrides
    pol = load(overrides.policy)
    given = f"{env.POLICY}={overrides.policy}"
    fields: dict[str, Any] = {}
    sources = dict(overrides.sources)
    half = parse_dtype(pol.half_dtype, "half_dtype") if levels.uses_half(pol.opt_level) else None
    values = {"opt_level": pol.opt_level, "half_dtype": half, "loss_scale": pol.loss_scale,
              "master_weights": pol.master_weights, "fp8": pol.fp8, "fp8_modules": pol.fp8_modules,
              "optimizer_states": parse_optimizer_states(pol.optimizer_states) if pol.optimizer_states else None}
    for name, value in values.items():  # a field the variables leave unset, where the file sets it
        if getattr(overrides, name) is None and value is not None:
            fields[name] = value
            shown = (getattr(pol, name) if name in ("opt_level", "half_dtype")
                     else repr(list(pol.fp8_modules or ()) if name == "fp8_modules" else getattr(pol, name)))
            sources[name] = f"{given} ({name} {shown})"
    fields["keep_fp32"] = tuple(dict.fromkeys((*overrides.keep_fp32, *pol.keep_fp32)))
    from_file = {name: f"{given} (keep_fp32)" for name in pol.keep_fp32 if name not in overrides.keep_fp32}
    return dataclasses.replace(overrides, **fields, sources=sources,
                               keep_fp32_sources={**overrides.keep_fp32_sources, **from_file})
