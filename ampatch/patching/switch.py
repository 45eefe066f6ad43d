"""Whether O1 casts run: a per-thread switch, on by default in every thread.

`disable_casts()` turns it off for a block in the calling thread only (the optimizer step
and the backend compile use it). Hot paths read `cast_switch.enabled` directly: an attribute
read of a thread-local is the cheapest test Python has, and every wrapper makes it.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class CastSwitch(threading.local):
    """`enabled`: whether casts run in this thread; the class attribute is each new
    thread's start value. Change it only through `disable_casts()`."""

    enabled = True


cast_switch = CastSwitch()


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the block without any ampatch casting, in this thread only."""
    previous = cast_switch.enabled
    cast_switch.enabled = False
    try:
        yield
    finally:
        cast_switch.enabled = previous
