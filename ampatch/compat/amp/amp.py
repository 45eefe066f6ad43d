"""`apex.amp.amp`: `amp.init()`, Apex's older O1-only entry point, and the user cast
registrations (`half_function`, `register_float_function`, ...), which are ampatch's own
(`ampatch.session.user_casts`).

`amp.init()` is `amp.initialize([], opt_level="O1")`: torch is patched, no model or optimizer
yet; it returns a `handle.Handle` over that session.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from ...config import values
from ...errors import ConfigTypeError
from ...session import user_casts
from ...session.session import current as _current
from .handle import Handle

if TYPE_CHECKING:
    from ...types import OptLevel

logger = logging.getLogger("ampatch")

__all__ = ["init", "half_function", "float_function", "promote_function", "bfloat16_function",
           "register_half_function", "register_float_function", "register_promote_function",
           "register_bfloat16_function"]

# ampatch's own (`ampatch.session.user_casts`), under Apex's module path
half_function, float_function = user_casts.half_function, user_casts.float_function
promote_function, bfloat16_function = user_casts.promote_function, user_casts.bfloat16_function
register_half_function, register_float_function = user_casts.register_half_function, user_casts.register_float_function
register_promote_function = user_casts.register_promote_function
register_bfloat16_function = user_casts.register_bfloat16_function


def init(enabled: bool = True, loss_scale: Any = "dynamic", enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False, patch_type: Any = None) -> Handle:
    """Apex's old entry point: patch torch as O1 (O4 with `patch_type=torch.bfloat16`, ROCm
    Apex's keyword) with no models or optimizers, and return a handle over that session."""
    for name, value in (("enabled", enabled), ("enable_caching", enable_caching), ("verbose", verbose)):
        if not isinstance(value, bool):
            raise ConfigTypeError(f"amp.init({name}=...) must be True or False, got {value!r}.")
    if not enabled:
        return Handle(None)
    if not enable_caching:
        logger.info("ampatch: amp.init(enable_caching=False): the cast cache stays on (it never serves a stale "
                    "or no_grad cast); results are the same as without it.")
    half = values.parse_dtype(patch_type, "patch_type")
    level: OptLevel = "O4" if half == torch.bfloat16 else "O1"
    from ... import initialize  # the public API, above this module
    initialize([], opt_level=level, loss_scale=loss_scale, allow_banned=allow_banned,
               half_dtype=half if level == "O1" else None, verbosity=2 if verbose else 1)
    return Handle(_current())

