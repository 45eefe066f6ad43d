"""A precision policy as a file: what `ampatch tune` chose, in a form training code reads.

A policy file is JSON with four fields that `amp.initialize` takes, and what they were
measured on::

    {"format": 1, "opt_level": "O1", "half_dtype": "bfloat16", "keep_fp32": ["head"],
     "loss_scale": null,
     "measured": {"tolerance": 0.02, "steps": 60, "speedup": 1.41, "deviation": 0.004,
                  "machine": {"type": "cpu", "name": "...", "native": {"bfloat16": true, ...}},
                  "torch": "2.13.0", "what": "built-in workload lm (small)", "date": "..."}}

``half_dtype`` is null at O0 (FP32); ``loss_scale`` null means the level's default (or the
script's own loss scale). It is applied three ways, all through `apply_policy`:

- in code, ``amp.initialize(..., policy="ampatch-policy.json")`` (a path or a dict): a
  keyword the call gives explicitly beats the file's field, with a warning when they disagree;
- from outside, ``AMPATCH_POLICY=path`` (what ``ampatch run --policy`` and ``ampatch compare
  --policy`` set) for an unmodified script: the file overrides the script's keywords, as
  ``AMPATCH_OPT_LEVEL`` does. Its ``keep_fp32`` is added to the script's own (as ``tune``
  measured it), and when it changes the level, the script's level-specific keywords
  (``cast_model_type``, ``patch_torch_functions``, ``keep_batchnorm_fp32``,
  ``master_weights``) are dropped with a warning: they were written for the script's level.

``AMPATCH_OPT_LEVEL``, ``AMPATCH_HALF_DTYPE``, ``AMPATCH_KEEP_FP32`` and
``AMPATCH_LOSS_SCALE`` still apply on top. A policy measured on another kind of machine
(another device type, or its half dtype native there and emulated here) warns: its
speed-up will not hold here.
"""
from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import env
from ..base import hardware
from .levels import LEVELS, half_dtype_conflict, parse_loss_scale
from ..base.notices import warn

__all__ = ["Policy", "PolicyError", "FORMAT", "FIELDS", "load", "save", "fingerprint", "machine_warning",
           "apply_policy", "takes_policy", "DEFAULT_PATH"]

FORMAT = 1
DEFAULT_PATH = "ampatch-policy.json"
FIELDS = ("opt_level", "half_dtype", "keep_fp32", "loss_scale")   # the initialize keywords a policy sets
KEYS = ("format", *FIELDS, "measured")                             # every key a policy file may have
# initialize keywords that only make sense for the level they were written for
LEVEL_KEYWORDS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights")


class PolicyError(ValueError):
    """A policy that cannot be applied: a missing or unreadable file, an unknown key, a bad
    value. The message names it and the fix."""


@dataclass(frozen=True)
class Policy:
    """One precision policy: the `initialize` keywords it sets, and what it was measured on
    (`measured`: tolerance, steps, speedup, deviation, machine, torch; None when written by hand)."""

    opt_level: str
    half_dtype: str | None = None
    keep_fp32: tuple[str, ...] = ()
    loss_scale: float | str | None = None
    measured: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    def keywords(self) -> dict[str, Any]:
        """The `initialize` keywords this policy sets (a field left null sets nothing)."""
        out: dict[str, Any] = {"opt_level": self.opt_level}
        if self.half_dtype is not None and self.opt_level != "O0":
            out["half_dtype"] = self.half_dtype
        if self.keep_fp32:
            out["keep_fp32"] = list(self.keep_fp32)
        if self.loss_scale is not None:
            out["loss_scale"] = self.loss_scale
        return out

    def to_dict(self) -> dict[str, Any]:
        """The file's JSON."""
        return {"format": FORMAT, "opt_level": self.opt_level, "half_dtype": self.half_dtype,
                "keep_fp32": list(self.keep_fp32), "loss_scale": self.loss_scale,
                "measured": dict(self.measured) if self.measured is not None else None}

    def describe(self) -> str:
        """One short line: "O1 bfloat16, keep_fp32=['head'], loss_scale='dynamic'"."""
        text = self.opt_level + (f" {self.half_dtype}" if self.half_dtype and self.opt_level != "O0" else "")
        if self.keep_fp32:
            text += f", keep_fp32={list(self.keep_fp32)}"
        if self.loss_scale is not None:
            text += f", loss_scale={self.loss_scale!r}"
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
    level = data.get("opt_level")
    if not isinstance(level, str) or level.strip().upper() not in LEVELS:
        raise PolicyError(f"{where}: opt_level must be one of {', '.join(LEVELS)}, got {level!r}.")
    level = level.strip().upper()
    half = data.get("half_dtype")
    if half is not None and half not in hardware.HALF_NAMES:
        raise PolicyError(f"{where}: half_dtype must be null, \"bfloat16\" or \"float16\", got {half!r}.")
    conflict = half_dtype_conflict(level, half)
    if conflict:
        raise PolicyError(f"{where}: {conflict}")
    keep = data.get("keep_fp32") or []
    if isinstance(keep, str):
        keep = [k for k in (s.strip() for s in keep.split(",")) if k]
    if not isinstance(keep, list) or not all(isinstance(k, str) and k.strip() for k in keep):
        raise PolicyError(f"{where}: keep_fp32 must be a list of module names (as named_modules() gives them), "
                          f"got {keep!r}.")
    scale = data.get("loss_scale")
    if scale is not None:
        try:
            scale = parse_loss_scale(scale)
        except (TypeError, ValueError) as exc:
            raise PolicyError(f"{where}: loss_scale: {exc}") from None
    measured = data.get("measured")
    if measured is not None and not isinstance(measured, Mapping):
        raise PolicyError(f"{where}: measured must be an object (or null), got {type(measured).__name__}.")
    return Policy(level, half if level != "O0" else None, tuple(k.strip() for k in keep), scale,
                  dict(measured) if measured is not None else None)


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


def fingerprint(device: str = "cpu") -> dict[str, Any]:
    """What a policy's speed depends on: the device type and name, and which half dtypes
    are native there."""
    info = hardware.describe(device)
    return {"type": info.type, "name": info.name, "native": dict(info.native)}


def machine_warning(policy: Policy, here: Mapping[str, Any] | None = None) -> str | None:
    """Why `policy`'s measurements may not hold on this machine (`here`: its `fingerprint`,
    default: of the device the policy was measured on), or None."""
    there = (policy.measured or {}).get("machine")
    if not isinstance(there, Mapping) or not there.get("type"):
        return None
    if here is None:
        if there["type"] == "cuda" and not torch.cuda.is_available():
            return (f"the policy was measured on {there.get('name') or 'a CUDA GPU'}; this machine has no CUDA: "
                    "its speed-up will not hold here (run `ampatch tune` here).")
        here = fingerprint("cuda" if there["type"] == "cuda" else "cpu")
    if here.get("type") != there["type"]:
        return (f"the policy was measured on {there['type']}, this run is on {here.get('type')}: its speed-up "
                "will not hold here (run `ampatch tune` here).")
    half = policy.half_dtype if policy.opt_level != "O0" else None
    native_there = (there.get("native") or {}).get(half) if half else None
    native_here = (here.get("native") or {}).get(half) if half else None
    if half and native_there is not None and native_here is not None and native_there != native_here:
        how = {True: "native", False: "emulated"}
        return (f"the policy was measured on {there.get('name')}, where {half} is {how[native_there]}; here "
                f"({here.get('name')}) it is {how[native_here]}: its speed-up will not hold here (run "
                "`ampatch tune` here).")
    return None


def apply_policy(keywords: dict[str, Any], policy: Any, explicit: Collection[str], forced: bool) -> dict[str, Any]:
    """`initialize`'s keywords with `policy` (a path, a dict, a `Policy`; None: none) applied.

    `explicit`: the keywords the call gave. In code (``forced=False``) an explicit keyword
    beats the policy's field, with a warning when they disagree; from outside
    (``forced=True``: ``AMPATCH_POLICY``) the policy overrides them (see the module
    docstring). Returns a new dict; raises `PolicyError` for a bad policy."""
    if policy is None:
        return dict(keywords)
    pol = load(policy)
    verbosity = keywords.get("verbosity", 1)
    why = machine_warning(pol)
    if why:
        warn(f"ampatch: {why}", verbosity)
    out = dict(keywords)
    wanted = pol.keywords()
    if forced:
        source = env.POLICY
        if out.get("opt_level", "O1").strip().upper() != pol.opt_level:
            dropped = [k for k in LEVEL_KEYWORDS if out.get(k) is not None]
            if dropped:
                warn(f"ampatch: {source} sets {pol.opt_level}: dropping the script's "
                     f"{', '.join(f'{k}={out[k]!r}' for k in dropped)}, written for its opt_level="
                     f"{out.get('opt_level', 'O1')}.", verbosity)
            for k in dropped:
                out.pop(k)
        for name in ("opt_level", "half_dtype", "loss_scale"):
            if name in wanted or name == "half_dtype":
                value = wanted.get(name)
                if name in explicit and out.get(name) is not None and out.get(name) != value and value is not None:
                    warn(f"ampatch: {source} overrides the script's {name}={out[name]!r} with {value!r}.", verbosity)
                out[name] = value
        if pol.keep_fp32:
            mine = out.get("keep_fp32")
            mine = [] if mine is None else list(mine) if isinstance(mine, (list, tuple)) else [mine]
            out["keep_fp32"] = mine + [k for k in pol.keep_fp32 if k not in mine]
        return out
    for name, value in wanted.items():
        if name in explicit:
            if out.get(name) != value:
                warn(f"ampatch: initialize's {name}={out.get(name)!r} beats the policy's {name}={value!r}.",
                     verbosity)
            continue
        out[name] = value
    return out


def takes_policy(initialize: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `initialize` so that its ``policy=`` keyword, then ``AMPATCH_POLICY``, are
    applied (`apply_policy`) to the keywords the call gave before it runs."""
    signature = inspect.signature(initialize)

    @functools.wraps(initialize)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = dict(signature.bind(*args, **kwargs).arguments)
        policy = given.pop("policy", None)
        outside = env.read().policy
        if policy is None and outside is None:
            return initialize(*args, **kwargs)
        explicit = set(given) - {"models", "optimizers"}
        given = apply_policy(given, policy, explicit, forced=False)
        given = apply_policy(given, outside, explicit, forced=True)
        return initialize(**given)
    return wrapper
