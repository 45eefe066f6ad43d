"""The O1 mechanism: wrapt wrappers that cast arguments, and a registry that puts every
patched attribute back exactly as it was.

Policy (which op gets which wrapper) lives in `ampatch.policy`; this module only knows
how to wrap. Whether casts run is a per-thread switch (`casts_enabled`), on by default in
every thread, so `disable_casts()` and the optimizer step affect only their own thread.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import wrapt

logger = logging.getLogger("ampatch")

HALF, FLOAT, PROMOTE, SEQUENCE_PROMOTE, BANNED, BFLOAT16 = (
    "half", "float", "promote", "sequence_promote", "banned", "bfloat16")
KINDS = (HALF, FLOAT, PROMOTE, SEQUENCE_PROMOTE, BANNED, BFLOAT16)


class _Switch(threading.local):
    """Per-thread cast switch; the class attribute makes it on in every new thread."""

    enabled = True


_switch = _Switch()


def casts_enabled() -> bool:
    """Whether patched functions cast in the calling thread."""
    return _switch.enabled


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """Run the block without any ampatch casting, in this thread only."""
    previous = _switch.enabled
    _switch.enabled = False
    try:
        yield
    finally:
        _switch.enabled = previous


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

    def __contains__(self, key: tuple[Any, str]) -> bool:
        return (id(key[0]), key[1]) in self._index

    def original(self, owner: Any, name: str) -> Any:
        """The attribute as it was before this patcher touched it."""
        rec = self._index.get((id(owner), name))
        return rec.original if rec else getattr(owner, name)

    def patch(self, owner: Any, name: str, replacement: Any) -> None:
        """Replace owner.name, once; a second patch of the same attribute is refused."""
        key = (id(owner), name)
        if key in self._index:
            raise RuntimeError(f"ampatch: {name} on {owner!r} is already patched in this session.")
        had_own = name in vars(owner)
        record = _Record(owner, name, vars(owner)[name] if had_own else getattr(owner, name), had_own, replacement)
        setattr(owner, name, replacement)
        self._records.append(record)
        self._index[key] = record

    def restore_all(self) -> None:
        """Undo every patch, newest first: originals back, inherited names deleted."""
        while self._records:
            rec = self._records.pop()
            del self._index[(id(rec.owner), rec.name)]
            current = vars(rec.owner).get(rec.name)
            if current is not rec.patched:
                logger.warning("ampatch: %s.%s was replaced by someone else after ampatch patched it; "
                               "restoring the original anyway.", getattr(rec.owner, "__name__", rec.owner), rec.name)
            if rec.had_own:
                setattr(rec.owner, rec.name, rec.original)
            elif rec.name in vars(rec.owner):
                delattr(rec.owner, rec.name)

    def __len__(self) -> int:
        return len(self._records)


# --------------------------------------------------------------------------- casting

_Tensor = torch.Tensor
_LOW = (torch.float16, torch.bfloat16)
_CASTABLE_TO_HALF = (torch.float32, torch.float16, torch.bfloat16)


def widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The promoted floating dtype over every floating tensor among args, kwargs and lists."""
    found = None
    for a in itertools.chain(args, kwargs.values()):
        items = a if type(a) in (list, tuple) else (a,)
        for t in items:
            if isinstance(t, _Tensor) and t.is_floating_point():
                found = t.dtype if found is None else torch.promote_types(found, t.dtype)
    return found


def any_low(args: tuple, kwargs: dict) -> bool:
    """Whether any tensor argument (or list element) is float16/bfloat16."""
    for a in itertools.chain(args, kwargs.values()):
        items = a if type(a) in (list, tuple) else (a,)
        for t in items:
            if isinstance(t, _Tensor) and t.dtype in _LOW:
                return True
    return False


class Caster:
    """Casts argument structures: tensors, and lists/tuples of tensors, one level deep.

    `cache_cast(t, dtype)` (the session's cast cache) does the actual conversion so that
    parameters are cast once per iteration.
    """

    __slots__ = ("cache_cast",)

    def __init__(self, cache_cast: Callable[[torch.Tensor, torch.dtype], torch.Tensor]) -> None:
        self.cache_cast = cache_cast

    def to_half(self, x: Any, dtype: torch.dtype) -> Any:
        """Floating non-double tensors to `dtype`; anything else unchanged."""
        if isinstance(x, _Tensor):
            if x.dtype is not dtype and x.dtype in _CASTABLE_TO_HALF:
                return self.cache_cast(x, dtype)
            return x
        if type(x) in (list, tuple):
            return type(x)([self.to_half(y, dtype) for y in x])
        return x

    def to_float(self, x: Any, dtype: torch.dtype = torch.float32) -> Any:
        """float16/bfloat16 tensors to float32; double and non-float tensors unchanged."""
        if isinstance(x, _Tensor):
            return self.cache_cast(x, torch.float32) if x.dtype in _LOW else x
        if type(x) in (list, tuple):
            return type(x)([self.to_float(y) for y in x])
        return x

    def to_exact(self, x: Any, dtype: torch.dtype) -> Any:
        """Any floating tensor (double too) to `dtype`: used for promotion."""
        if isinstance(x, _Tensor):
            return self.cache_cast(x, dtype) if x.dtype is not dtype and x.is_floating_point() else x
        if type(x) in (list, tuple):
            return type(x)([self.to_exact(y, dtype) for y in x])
        return x


# --------------------------------------------------------------------------- wrappers

class Counters:
    """Thread-safe call counters: `next()` on an itertools.count is atomic under the GIL."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], itertools.count] = {}
        self._lock = threading.Lock()

    def counter(self, op: str, dtype: str) -> itertools.count:
        with self._lock:
            return self._counts.setdefault((op, dtype), itertools.count())

    def snapshot(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (op, dtype), c in list(self._counts.items()):
            n = c.__reduce__()[1][0]
            if n:
                out.setdefault(op, {})[dtype] = n
        return out


@dataclass
class WrapContext:
    """What a wrapper needs from its session, captured once at patch time."""

    caster: Caster
    half_dtype: torch.dtype
    counters: Counters
    allow_banned: bool
    timer: Any = None  # a callable(seconds) when timing telemetry is on


def make_wrapper(kind: str, op: str, original: Any, ctx: WrapContext, banned_message: str = "") -> Callable:
    """Build the wrapt wrapper function for one op of one kind.

    `original` is called unbound (`original(self, *args)`) for Tensor methods so that the
    tensor itself is cast too.
    """
    caster = ctx.caster
    if kind == BFLOAT16:
        kind, target = HALF, torch.bfloat16
    else:
        target = ctx.half_dtype
    switch = _switch
    if kind == HALF:
        tick = ctx.counters.counter(op, str(target).removeprefix("torch."))
        to_half = caster.to_half

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            next(tick)
            return (tuple([to_half(a, target) for a in args]),
                    {k: to_half(v, target) for k, v in kwargs.items()} if kwargs else kwargs)
    elif kind == FLOAT or (kind == BANNED and ctx.allow_banned):
        tick = ctx.counters.counter(op, "float32")
        to_float = caster.to_float

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            next(tick)
            return (tuple([to_float(a) for a in args]),
                    {k: to_float(v) for k, v in kwargs.items()} if kwargs else kwargs)
    elif kind in (PROMOTE, SEQUENCE_PROMOTE):
        in_place = op.endswith("_") and not op.endswith("__")
        to_exact = caster.to_exact
        counters = ctx.counters

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if in_place and args and isinstance(args[0], _Tensor):
                dtype = args[0].dtype  # an in-place op keeps self's dtype; the others follow it
            else:
                dtype = widest(args, kwargs)
            if dtype is None:
                return args, kwargs
            new_args = tuple([to_exact(a, dtype) for a in args])
            new_kwargs = {k: to_exact(v, dtype) for k, v in kwargs.items()} if kwargs else kwargs
            if any(x is not y for x, y in zip(new_args, args)) or new_kwargs != kwargs:
                next(counters.counter(op, str(dtype).removeprefix("torch.")))
            return new_args, new_kwargs
    elif kind == BANNED:
        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if any_low(args, kwargs):  # FP32 inputs are safe: nothing to protect, as in Apex
                raise NotImplementedError(banned_message)
            return args, kwargs
    else:
        raise ValueError(f"unknown cast kind {kind!r}")

    timer = ctx.timer
    if timer is None:
        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            if not switch.enabled:
                return wrapped(*args, **kwargs)
            if instance is not None:
                args = (instance,) + args
            args, kwargs = convert(args, kwargs)
            return original(*args, **kwargs)
    else:
        perf = time.perf_counter

        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            if not switch.enabled:
                return wrapped(*args, **kwargs)
            start = perf()
            if instance is not None:
                args = (instance,) + args
            args, kwargs = convert(args, kwargs)
            mid = perf()
            try:
                return original(*args, **kwargs)
            finally:
                timer(mid - start)
    return wrapper


def wrap(kind: str, op: str, original: Any, ctx: WrapContext, banned_message: str = "") -> wrapt.FunctionWrapper:
    """A wrapt FunctionWrapper around `original` (keeps its name, docs and identity checks)."""
    return wrapt.FunctionWrapper(original, make_wrapper(kind, op, original, ctx, banned_message))
