"""The one live session of the process: a single reference, not scattered globals.

`ampatch/__init__.py` sets it (`initialize`, `deinitialize`); the module-level API and
Apex's compatibility views read it. Apex's once-only `initialize` and global `_amp_state`
are what this replaces: a new `initialize` closes the previous session first.
"""
from __future__ import annotations

from typing import Any

__all__ = ["current", "set_current"]


class _Live:
    session: Any = None  # a session.Session (not imported: the session sits above this)


def current() -> Any:
    """The live session (`session.Session`), or None before `initialize` and after `deinitialize`."""
    return _Live.session


def set_current(session: Any) -> Any:
    """Make `session` the live one; returns the one it replaces (the caller closes it)."""
    previous, _Live.session = _Live.session, session
    return previous
