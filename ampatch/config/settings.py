"""Process-wide settings that outlive a session.

Apex kept three flags on its global `_amp_state` that scripts set before `initialize`:
`hard_override` (refused overrides only warn), `allow_incoming_model_not_fp32` (float16
models are accepted) and `verbosity`. They live here, in the core, where `initialize`
reads them; `amp._amp_state` (ampatch.compat.amp._amp_state) is a view that reads and writes them.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Settings", "SETTINGS"]


@dataclass
class Settings:
    """The flags; each a plain value, checked where it is set (see compat.amp._amp_state)."""

    hard_override: bool = False
    allow_incoming_model_not_fp32: bool = False
    verbosity: int = 1  # the default for a session; initialize(verbosity=...) sets its own


SETTINGS = Settings()
