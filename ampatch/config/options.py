"""`initialize`'s keywords as one frozen, checked object, and everything checked before a
session starts.

`Options` holds the keywords (like minGPT's config: one object, handed on whole) and checks
each when it is made, so an `Options` is always valid. `prepare` adds what needs the models
and the environment (the models and optimizers as lists, the resolved `properties.Properties`)
and still changes nothing: a call it rejects leaves the previous session, the models and
the "ampatch" logger as they were. `Prepared.announce` then says what the checks found, at
the new session's verbosity.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..machine import hardware
from ..base.notices import warn
from ..model import hf_conventions
from . import properties
from .env import Overrides
from .settings import SETTINGS
from .values import DEFAULT_MAX_LOSS_SCALE, DYNAMIC, INITIAL_LOSS_SCALE, check_scale_value, parse_dtype

logger = logging.getLogger("ampatch")

__all__ = ["Options", "Prepared", "prepare", "as_list", "optimizer_list", "DEFAULT_MAX_LOSS_SCALE"]


@dataclass(frozen=True)
class Options:
    """The keywords of `ampatch.initialize` (same names, same defaults, same order), checked
    on creation; `half_dtype` also takes `patch_torch_functions_type` (its ROCm Apex alias),
    and the loss-scale bounds are floats. `policy` is not one: a policy file of `ampatch tune`
    has been applied to the other fields (`policy_file.takes_policy`) before they get here."""

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
        alias = self.patch_torch_functions_type
        if alias is not None:
            if self.half_dtype is not None and parse_dtype(self.half_dtype, "half_dtype") != parse_dtype(
                    alias, "patch_torch_functions_type"):
                raise ValueError("half_dtype and patch_torch_functions_type (its ROCm Apex alias) disagree; pass one.")
            object.__setattr__(self, "half_dtype", alias)
        if not isinstance(self.num_losses, int) or isinstance(self.num_losses, bool) or self.num_losses < 1:
            raise ValueError(f"num_losses must be a positive int, got {self.num_losses!r}.")
        if not isinstance(self.verbosity, int):
            raise TypeError(f"verbosity must be an int (0 silences ampatch), got {self.verbosity!r}.")
        low = None if self.min_loss_scale is None else check_scale_value(self.min_loss_scale, "min_loss_scale")
        high = float(check_scale_value(self.max_loss_scale, "max_loss_scale"))
        if low is not None and low > high:
            raise ValueError(f"min_loss_scale={low} exceeds max_loss_scale={high}.")
        object.__setattr__(self, "min_loss_scale", low)
        object.__setattr__(self, "max_loss_scale", high)
        if not isinstance(self.allow_banned, bool):
            raise TypeError(f"allow_banned must be True or False, got {self.allow_banned!r}.")
        _check_process_group(self.process_group)

    def properties(self, device: torch.device | None, overrides: Overrides) -> tuple[properties.Properties, list[str]]:
        """The session's properties on `device` under `overrides`, and the warnings to log
        about them (`properties.resolve`)."""
        notes: list[str] = []
        props = properties.resolve(
            self.opt_level, device=device, enabled=self.enabled, half_dtype=self.half_dtype,
            cast_model_outputs=self.cast_model_outputs, hard_override=SETTINGS.hard_override, overrides=overrides,
            notes=notes, cast_model_type=self.cast_model_type, patch_torch_functions=self.patch_torch_functions,
            keep_batchnorm_fp32=self.keep_batchnorm_fp32, master_weights=self.master_weights,
            loss_scale=self.loss_scale)
        return props, notes


@dataclass(frozen=True)
class Prepared:
    """A checked `initialize` call: what the session is made from, and how to hand back."""

    options: Options
    properties: properties.Properties
    overrides: Overrides
    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    single_model: bool
    single_optimizer: bool
    no_optimizers: bool
    notes: list[str] = dataclasses.field(default_factory=list)

    def announce(self) -> None:
        """Log what the checks found (forced overrides, unused loss-scale bounds); called once
        the logger follows the new session's verbosity."""
        for note in self.notes:
            logger.warning(note)
        o, scale = self.options, self.properties.loss_scale
        if scale != DYNAMIC:
            if o.min_loss_scale is not None or o.max_loss_scale != DEFAULT_MAX_LOSS_SCALE:
                logger.info("ampatch: min_loss_scale/max_loss_scale bound a dynamic loss scale; this session's is "
                            "static (%g), so they do not apply.", scale)
        elif o.min_loss_scale is not None and o.min_loss_scale > INITIAL_LOSS_SCALE:
            warn(f"ampatch: min_loss_scale={o.min_loss_scale:g} is above the initial dynamic loss scale "
                 f"{INITIAL_LOSS_SCALE:g}: the scale starts at min_loss_scale.", o.verbosity)

    def returned(self) -> Any:
        """The models and optimizers in the shape `initialize` got them (only the models when
        it got no optimizers)."""
        models = self.models[0] if self.single_model else self.models
        if self.no_optimizers:
            return models
        return models, (self.optimizers[0] if self.single_optimizer else self.optimizers)


def prepare(options: Options, models: Any, optimizers: Any, overrides: Overrides) -> Prepared:
    """Everything about an `initialize` call that can be checked before it changes anything."""
    model_list, single_model = as_list(models, "models", nn.Module)
    if optimizers is None:
        opt_list, single_opt = [], True
    else:
        opt_list, single_opt = as_list(optimizers, "optimizers", torch.optim.Optimizer)
    hf_conventions.check_not_accelerated(model_list, opt_list)
    device = hardware.model_device(model_list)  # the same device hardware.check_half describes
    props, notes = options.properties(device, overrides)
    return Prepared(options, props, overrides, model_list, opt_list, single_model, single_opt, optimizers is None,
                    notes)


def as_list(x: Any, what: str, kind: type) -> tuple[list, bool]:
    """`x` (one object or a list/tuple of them) as a list, and whether it was one object;
    each item checked to be a `kind`, given once, and (models) not wrapped yet."""
    if isinstance(x, (list, tuple)):
        items, single = list(x), False
    else:
        items, single = [x], True
    for i, item in enumerate(items):
        first = next(j for j, other in enumerate(items) if other is item)
        if first != i:
            raise ValueError(f"amp.initialize got the same {what[:-1]} twice: {what}[{i}] is {what}[{first}] "
                             f"({type(item).__name__}); pass each of the {what} once.")
        if what == "models" and isinstance(item, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise RuntimeError(f"amp.initialize got a model already wrapped in {type(item).__name__}; call "
                               "amp.initialize on the bare model first, then wrap the model it returns.")
        if not isinstance(item, kind):
            raise TypeError(f"amp.initialize expects {what} to be {kind.__name__} objects (or a list of them), "
                            f"got {type(item).__name__}.")
    return items, single


def optimizer_list(optimizers: Any) -> list[torch.optim.Optimizer]:
    """`scale_loss`'s optimizers (one or a list/tuple) as a list: at least one, each once."""
    opts = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    if not opts:
        raise ValueError("scale_loss got no optimizer: pass the optimizer(s) whose params this loss's "
                         "backward reaches (they unscale the grads and skip the step on overflow).")
    for i, o in enumerate(opts):
        if any(o is other for other in opts[:i]):
            raise ValueError(f"scale_loss got the same optimizer twice (optimizers[{i}]); pass each once, or "
                             "its grads would be unscaled twice.")
    return opts


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
