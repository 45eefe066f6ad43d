"""Functions registered by the user (`amp.register_half_function` and friends).

Policy like the built-in lists: kept for the whole process, across `deinitialize` and a
new `initialize`, and applied after the built-in lists so a registration wins.
"""
from __future__ import annotations

from typing import Any

from ampatch.errors import ConfigError

REGISTERED: list[tuple[Any, str, str]] = []  # (owner object, attribute name, cast kind)


def register(owner: Any, name: str, kind: str) -> None:
    """Record that owner.name gets the `kind` wrapper; the newest registration wins."""
    if not hasattr(owner, name):
        raise ConfigError(f"{getattr(owner, '__name__', owner)!s} has no attribute {name!r} to register.")
    REGISTERED[:] = [r for r in REGISTERED if not (r[0] is owner and r[1] == name)]
    REGISTERED.append((owner, name, kind))
