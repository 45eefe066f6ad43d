"""The undo registry every patch goes through, and the per-thread switch of O1's casts.

`Patcher` sets attributes (on torch, on a user's model or optimizer) and puts each back
exactly as it was; the core and the framework plugins share it. Some names are inherited
(`torch.Tensor.matmul` lives on `torch._C.TensorBase`), others are the owner's own: each
record says which, so a restore deletes what was not there instead of setting it.
`disable_casts()` turns casting off for a block in the calling thread only. A patch someone
else replaced is restored with a warning, unless a registered `tolerate` predicate expects
that replacement (what other libraries do to patched attributes, registered from above).

Writes through `Tensor.data` (`p.data.clamp_(...)`, `p.data = ...`) move no version counter,
so whoever keeps a second copy of a tensor cannot see them: `watch_data` patches
`torch.Tensor.data` to call back with the tensor each time it is read or assigned.
`raw_data` / `set_data` are torch's own access, for ampatch's reads and writes.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ampatch.errors import OrderError

logger = logging.getLogger("ampatch")

__all__ = ["Patcher", "resolve_owner", "tolerate", "CastSwitch", "cast_switch", "disable_casts", "TENSOR_DATA",
           "raw_data", "set_data", "watch_data"]

# Predicates on what replaced a patch: True where the replacement is expected, not news.
_tolerated: list[Callable[[Any], bool]] = []


def tolerate(expected: Callable[[Any], bool]) -> None:
    """Restore a patch that someone replaced without a warning where `expected(replacement)`
    (e.g. an LR scheduler's wrapper around a patched `optimizer.step`)."""
    if expected not in _tolerated:
        _tolerated.append(expected)


def resolve_owner(path: str) -> Any:
    """"torch.nn.functional" -> the module; "torch.Tensor" -> the class."""
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, attr = path.rpartition(".")
        return getattr(importlib.import_module(module), attr)


@dataclass
class _Record:
    owner: Any
    name: str
    original: Any
    had_own: bool  # was `name` in owner.__dict__ (else it was inherited / resolved lazily)
    patched: Any


class Patcher:
    """Sets attributes on torch objects and remembers how to undo each one exactly."""

    def __init__(self) -> None:
        self._records: list[_Record] = []
        self._index: dict[tuple[int, str], _Record] = {}
        self._undo: list[Callable[[], None]] = []

    def __contains__(self, key: tuple[Any, str]) -> bool:
        return (id(key[0]), key[1]) in self._index

    def patch(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace owner.name, once; a second patch of the same attribute is refused."""
        key = (id(owner), name)
        if key in self._index:
            raise OrderError(f"ampatch: {name} on {owner!r} is already patched in this session.")
        had_own = name in vars(owner)
        record = _Record(owner, name, vars(owner)[name] if had_own else getattr(owner, name), had_own, replacement)
        setattr(owner, name, replacement)
        self._records.append(record)
        self._index[key] = record

    def patched(self) -> list[tuple[Any, str, Any, Any]]:
        """(owner, name, original, replacement) of every live patch, oldest first."""
        return [(r.owner, r.name, r.original, r.patched) for r in self._records]

    def on_restore(self, undo: Callable[[], None]) -> None:
        """Run `undo` in `restore_all`, after the attributes are back (newest first)."""
        self._undo.append(undo)

    def restore_all(self) -> None:
        """Undo every patch, newest first: originals back, inherited names deleted; then
        the `on_restore` callbacks."""
        while self._records:
            rec = self._records.pop()
            del self._index[(id(rec.owner), rec.name)]
            current = vars(rec.owner).get(rec.name)
            if current is not rec.patched and not any(expected(current) for expected in _tolerated):
                logger.warning("ampatch: %s.%s was replaced by someone else after ampatch patched it; "
                               "restoring the original anyway.", getattr(rec.owner, "__name__", rec.owner), rec.name)
            if rec.had_own:
                setattr(rec.owner, rec.name, rec.original)
            elif rec.name in vars(rec.owner):
                delattr(rec.owner, rec.name)
        while self._undo:
            self._undo.pop()()

    def __len__(self) -> int:
        return len(self._records)


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


TENSOR_DATA = vars(torch._C.TensorBase)["data"]  # the C getset `Tensor.data`


def raw_data(t: torch.Tensor) -> torch.Tensor:
    """`t.data` as torch gives it, past any watch."""
    return TENSOR_DATA.__get__(t)


def set_data(t: torch.Tensor, value: torch.Tensor) -> None:
    """`t.data = value` as torch does it, past any watch."""
    TENSOR_DATA.__set__(t, value)


def watch_data(patcher: Patcher, touched: Callable[[torch.Tensor], None]) -> None:
    """From now until `patcher` restores torch, `touched(t)` runs before each read or
    assignment of `t.data` (any tensor: `touched` picks its own)."""
    get, put = TENSOR_DATA.__get__, TENSOR_DATA.__set__

    def data(self: torch.Tensor) -> torch.Tensor:
        touched(self)
        return get(self)

    def assign(self: torch.Tensor, value: torch.Tensor) -> None:
        touched(self)
        put(self, value)

    patcher.patch(torch.Tensor, "data", property(data, assign, doc=TENSOR_DATA.__doc__))
