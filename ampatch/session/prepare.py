"""The checks of an `initialize` call as a whole, before anything changes (`prepare`): the
models and optimizers (each once, none wrapped yet), the options with the environment's
overrides (`config.options.resolve`), what other libraries prepared (the checks registered
with `session.addons`), fp8 and the optimizer-state precision. A call it rejects leaves the
previous session, the models and the "ampatch" logger as they were. `check_incoming_dtypes`
runs once the previous session let go of the models.

What the environment asks is read once per call (`outside`: the ``AMPATCH_*`` variables of
`config.env`, with the policy file ``AMPATCH_POLICY`` names merged in); a policy given in
code is `initialize`'s `policy=` (`takes_policy`). A policy measured on another kind of
machine is warned about (`machine.hardware.policy_warning`).
"""
from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..base.notices import warn
from ..config import env, levels, policy_file
from ..config.env import Overrides
from ..config.options import Options, Properties, resolve, warn_or_err
from ..config.settings import SETTINGS
from ..config.values import DEFAULT_MAX_LOSS_SCALE, DYNAMIC, INITIAL_LOSS_SCALE
from ..errors import ConfigError, ConfigTypeError, OrderError
from ..machine import hardware
from ..model import cast, fp8
from ..optim.states import check_keepable
from . import addons

logger = logging.getLogger("ampatch")

__all__ = ["takes_policy", "outside", "Prepared", "prepare", "check_fp8", "as_list", "check_incoming_dtypes"]


def takes_policy(initialize: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `initialize` so that `policy=` (a policy file `ampatch tune` wrote, or its
    dict) sets the keywords the call does not give; a keyword given explicitly beats the
    policy's field, with a warning when they disagree (`policy_file.apply_in_code`)."""
    signature = inspect.signature(initialize)

    @functools.wraps(initialize)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("policy") is None:
            return initialize(*args, **kwargs)
        given = dict(signature.bind(*args, **kwargs).arguments)
        policy = policy_file.load(given.pop("policy"))
        _warn_measured_elsewhere(policy, given.get("verbosity", 1))
        return initialize(**policy_file.apply_in_code(given, policy, set(given) - {"models", "optimizers"}))
    return wrapper


def outside(verbosity: int = 1) -> Overrides:
    """What the environment asks of this `initialize`, read once, with the policy file
    ``AMPATCH_POLICY`` names merged in (`policy_file.from_outside`)."""
    overrides = env.read()
    if overrides.policy is None:
        return overrides
    _warn_measured_elsewhere(policy_file.load(overrides.policy), verbosity)
    return policy_file.from_outside(overrides)


def _warn_measured_elsewhere(policy: policy_file.Policy, verbosity: int) -> None:
    why = hardware.policy_warning(policy.measured, levels.half_name(policy.opt_level, policy.half_dtype))
    if why:
        warn(f"ampatch: {why}", verbosity if isinstance(verbosity, int) else 1)


@dataclass(frozen=True)
class Prepared:
    """A checked `initialize` call: what the session is made from, and how to hand back."""

    options: Options
    properties: Properties
    overrides: Overrides
    models: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    single_model: bool
    single_optimizer: bool
    no_optimizers: bool
    notes: list[str] = field(default_factory=list)

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
    """Everything about an `initialize` call that can be checked before it changes anything:
    the models and optimizers (each once, none wrapped or accelerated yet) and the options
    as a whole."""
    model_list, single_model = as_list(models, "models", nn.Module)
    opt_list, single_opt = ([], True) if optimizers is None else as_list(optimizers, "optimizers",
                                                                          torch.optim.Optimizer)
    addons.run_checks(model_list, opt_list)  # what other libraries prepared (frameworks/)
    cast.check_dtensors_sharded(model_list)
    props, notes = resolve(options, hardware.model_device(model_list), overrides)
    if props.fp8 is not None:
        check_fp8(props, opt_list)
    if props.optimizer_states.stored:  # (the optimizer's own state needs no check)
        for o in opt_list:
            check_keepable(o, props.optimizer_states)
    return Prepared(options, props, overrides, model_list, opt_list, single_model, single_opt, optimizers is None,
                    notes)


def check_fp8(props: Properties, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """What `fp8=` needs before anything changes: torchao that fits (ImportError naming the
    extra), and an optimizer that tolerates it."""
    fp8.require()
    for o in optimizers:
        if isinstance(o, torch.optim.LBFGS):
            raise ConfigError("fp8 with torch.optim.LBFGS: its line search and curvature pairs compare the losses and "
                              "gradients of re-evaluated closures, which FP8's dynamic scaling perturbs by a few "
                              "percent each time. Use a first-order optimizer (SGD, AdamW, ...) with fp8, or leave "
                              "fp8 off with LBFGS.")


def as_list(x: Any, what: str, kind: type) -> tuple[list, bool]:
    """`x` (one object or a list/tuple of them) as a list, and whether it was one object;
    each item checked to be a `kind`, given once, and (models) not wrapped yet."""
    items, single = (list(x), False) if isinstance(x, (list, tuple)) else ([x], True)
    for i, item in enumerate(items):
        first = next(j for j, other in enumerate(items) if other is item)
        if first != i:
            raise ConfigError(f"amp.initialize got the same {what[:-1]} twice: {what}[{i}] is {what}[{first}] "
                              f"({type(item).__name__}); pass each of the {what} once.")
        if what == "models" and isinstance(item, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            raise OrderError(f"amp.initialize got a model already wrapped in {type(item).__name__}; call "
                             "amp.initialize on the bare model first, then wrap the model it returns.")
        if not isinstance(item, kind):
            raise ConfigTypeError(f"amp.initialize expects {what} to be {kind.__name__} objects (or a list of them), "
                                  f"got {type(item).__name__}.")
    return items, single


def check_incoming_dtypes(models: Sequence[nn.Module]) -> None:
    """Apex's refusal of float16 models (`warn_or_err` at the first float16 tensor):
    `initialize` takes the FP32 model and does the casting itself. Checked once the previous
    session let go of the models (it may have cast them); Apex's
    `_amp_state.allow_incoming_model_not_fp32 = True` lets them in."""
    if SETTINGS.allow_incoming_model_not_fp32:
        return
    for model in models:
        tensors: list[tuple[str, str, torch.Tensor]] = [("param", n, t) for n, t in model.named_parameters()]
        tensors += [("buffer", n, t) for n, t in model.named_buffers()]
        for kind, name, t in tensors:
            if t.dtype == torch.float16:
                warn_or_err(f"Found {kind} {name} of dtype {t.dtype}; amp.initialize expects an FP32 model and "
                            "does any casting itself: do not call .half() on the model before passing it. To "
                            "pass float16 parameters on purpose, set amp._amp_state.allow_incoming_model_not_fp32 "
                            "= True before amp.initialize.", SETTINGS.hard_override)
                return
