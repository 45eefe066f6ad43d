"""Call counters that threads share: the hot path's only bookkeeping (each O1 wrapper counts
its casts, the cast cache its hits and misses).

`next()` on an `itertools.count` is atomic under the GIL, so counting takes no lock; a lock
is taken only to make a counter the first time a key is seen.
"""
from __future__ import annotations

import itertools
import threading
import typing

__all__ = ["Counters", "count_value"]


def count_value(counter: itertools.count) -> int:
    """The next value an itertools.count would return, without advancing it."""
    reduced = typing.cast(tuple, counter.__reduce__())  # count pickles as (count, (next value,))
    return int(reduced[1][0])


class Counters:
    """Thread-safe call counters: `next()` on an itertools.count is atomic under the GIL."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], itertools.count] = {}
        self._lock = threading.Lock()

    def counter(self, op: str, dtype: str) -> itertools.count:
        """The counter of (op, dtype), made once: later calls read it without the lock."""
        found = self._counts.get((op, dtype))
        if found is not None:
            return found
        with self._lock:
            return self._counts.setdefault((op, dtype), itertools.count())

    def snapshot(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (op, dtype), c in list(self._counts.items()):
            n = count_value(c)
            if n:
                out.setdefault(op, {})[dtype] = n
        return out
