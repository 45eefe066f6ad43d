"""What the environment asks of an `initialize` call, read once: the ``AMPATCH_*`` variables
(`config.env`) with the policy file ``AMPATCH_POLICY`` names merged in (`outside`), and a
policy given in code (`takes_policy`, `initialize`'s `policy=`); a policy measured on
another kind of machine is warned about (`machine.hardware.policy_warning`).
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..base.notices import warn
from ..config import env, levels, policy_file
from ..config.env import Overrides
from ..machine import hardware

__all__ = ["takes_policy", "outside"]


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
