"""`initialize`'s keywords as one frozen `Options`, every keyword parsed and checked on its own.

`Options` is made once per `initialize` call and handed on whole (like minGPT's config).
Each field holds the parsed value (a dtype, a bool, a float scale, a normalized level), so
nothing downstream parses again; `properties.resolve` then checks the keywords as a whole
against the level, the device and the environment. Both run before anything changes.
A policy file given as `policy=` is applied to the keywords first (`session.build.takes_policy`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..base.notices import warn
from . import levels
from .values import (DEFAULT_MAX_LOSS_SCALE, check_scale_value, parse_bool, parse_dtype, parse_loss_scale,
                     parse_master_weights)

__all__ = ["Options", "OverrideError", "warn_or_err", "NO_CAST", "PROPERTY_KEYWORDS"]

NO_CAST = "no cast"  # cast_model_type=False: Apex's "leave the model as it is", at any level
# The keywords that override a level's defaults (Apex's `amp` properties); None: the level's own.
PROPERTY_KEYWORDS = ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights",
                     "loss_scale")


class OverrideError(ValueError, RuntimeError):
    """An override Apex refused (its `warn_or_err`): a ValueError like every configuration
    error here, and the RuntimeError Apex raised. `hard_override=True` makes it a warning."""


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
    `half_dtype` taking `patch_torch_functions_type` (its ROCm Apex alias)."""

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

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        if not isinstance(self.enabled, bool):
            raise TypeError(f"enabled must be True or False, got {self.enabled!r}.")
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
                raise ValueError("half_dtype and patch_torch_functions_type (its ROCm Apex alias) disagree; pass one.")
            half = alias
        if half == torch.float32:
            raise ValueError("half_dtype=torch.float32 is not a half type; use opt_level='O0' for FP32.")
        put("half_dtype", half)
        if not isinstance(self.num_losses, int) or isinstance(self.num_losses, bool) or self.num_losses < 1:
            raise ValueError(f"num_losses must be a positive int, got {self.num_losses!r}.")
        if not isinstance(self.verbosity, int):
            raise TypeError(f"verbosity must be an int (0 silences ampatch), got {self.verbosity!r}.")
        low = None if self.min_loss_scale is None else check_scale_value(self.min_loss_scale, "min_loss_scale")
        high = float(check_scale_value(self.max_loss_scale, "max_loss_scale"))
        if low is not None and low > high:
            raise ValueError(f"min_loss_scale={low} exceeds max_loss_scale={high}.")
        put("min_loss_scale", low)
        put("max_loss_scale", high)
        if not isinstance(self.allow_banned, bool):
            raise TypeError(f"allow_banned must be True or False, got {self.allow_banned!r}.")
        _check_process_group(self.process_group)

    def given(self) -> dict[str, Any]:
        """The property keywords that were given (not None), in the signature's order."""
        return {name: getattr(self, name) for name in PROPERTY_KEYWORDS if getattr(self, name) is not None}

    def replace(self, **changes: Any) -> Options:
        """A copy with `changes` (parsed like the rest)."""
        return dataclasses.replace(self, **changes)


def _check_process_group(group: Any) -> None:
    """`process_group` is None (the world) or a torch.distributed group this rank belongs to."""
    if group is None:
        return
    if not torch.distributed.is_available():
        raise RuntimeError("process_group was given, but this torch build has no torch.distributed.")
    if isinstance(group, int) and group == torch.distributed.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("process_group: this rank is not a member of that group (torch.distributed.new_group "
                         "returned NON_GROUP_MEMBER here); pass a group that contains this rank, or None.")
    if not isinstance(group, torch.distributed.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed process group (from "
                        f"torch.distributed.new_group) or None for the world, got {type(group).__name__}.")
