"""The O1 mechanism: wrapt wrappers that cast arguments, and a registry that puts every
patched attribute back exactly as it was.

Policy (which op gets which wrapper) lives in `ampatch.policy`; this module only knows
how to wrap. Whether casts run is a per-thread switch (`_switch.enabled`), on by default in
every thread, so `disable_casts()` and the optimizer step affect only their own thread.

Each wrapper also carries a plain-Python twin (`make_traceable`) that `torch.compile`
traces instead of the wrapper, so the casts become nodes of the captured graph (see
`_FunctionWrapper`; `ampatch.dynamo` covers Tensor methods and operators).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import wrapt

from .cache import CastCache
from .dtypes import CASTABLE, LOW
from .telemetry import Counters
from .tips import hint_dtype_error

logger = logging.getLogger("ampatch")

HALF, FLOAT, PROMOTE, SEQUENCE_PROMOTE, BANNED, BFLOAT16, CPU_FLOAT = (
    "half", "float", "promote", "sequence_promote", "banned", "bfloat16", "cpu_float")


class _Switch(threading.local):
    """Per-thread cast switch; the class attribute makes it on in every new thread."""

    enabled = True


_switch = _Switch()


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
        self._undo: list[Callable[[], None]] = []

    def __contains__(self, key: tuple[Any, str]) -> bool:
        return (id(key[0]), key[1]) in self._index

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
            if current is not rec.patched and not getattr(current, "_wrapped_by_lr_sched", False):
                # (an LR scheduler wrapping a patched optimizer.step is expected, not news)
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


# --------------------------------------------------------------------------- casting

_Tensor = torch.Tensor
_SEQ = (list, tuple)


# A call with an explicit `out=` tensor is never cast (as under torch.autocast, where such
# calls are not eligible): a cast `out` would be a temporary copy, the result would land in
# it and the caller's tensor would stay as it was (torch.compile's inductor code calls
# `torch.bmm(a, b, out=buf)` on FP32 buffers while a session patches torch, and read
# uninitialized memory back). The op runs as the caller wrote it, mixed dtypes included.
_NOT_ELIGIBLE = "out"


def widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    """The promoted floating dtype over every floating tensor among args, kwargs and lists."""
    found = None
    for a in itertools.chain(args, kwargs.values()):
        items = a if type(a) in _SEQ else (a,)
        for t in items:
            if isinstance(t, _Tensor) and t.is_floating_point():
                found = t.dtype if found is None else torch.promote_types(found, t.dtype)
    return found


def any_low(args: tuple, kwargs: dict) -> bool:
    """Whether any tensor argument (or list element) is float16/bfloat16."""
    for a in itertools.chain(args, kwargs.values()):
        items = a if type(a) in _SEQ else (a,)
        for t in items:
            if isinstance(t, _Tensor) and t.dtype in LOW:
                return True
    return False


class Caster:
    """Casts argument structures: tensors, and lists/tuples of tensors, one level deep.

    The session's `CastCache` does the conversion, so parameters are cast once per
    iteration; `for_dtype(dtype)` is its closure for one target dtype. A list or tuple in
    which nothing needs a cast comes back as the very same object.
    """

    __slots__ = ("for_dtype",)

    def __init__(self, cache: CastCache) -> None:
        self.for_dtype = cache.caster

    def to_half(self, x: Any, dtype: torch.dtype) -> Any:
        """Floating non-double tensors to `dtype`; anything else unchanged."""
        if isinstance(x, _Tensor):
            d = x.dtype
            if d is not dtype and d in CASTABLE:
                return self.for_dtype(dtype)(x)
            return x
        if type(x) in _SEQ:
            return _map_seq(x, lambda y: self.to_half(y, dtype))
        return x

    def to_float(self, x: Any) -> Any:
        """float16/bfloat16 tensors to float32; double and non-float tensors unchanged."""
        if isinstance(x, _Tensor):
            return self.for_dtype(torch.float32)(x) if x.dtype in LOW else x
        if type(x) in _SEQ:
            return _map_seq(x, self.to_float)
        return x

    def to_exact(self, x: Any, dtype: torch.dtype) -> Any:
        """Any floating tensor (double too) to `dtype`: used for promotion."""
        if isinstance(x, _Tensor):
            return self.for_dtype(dtype)(x) if x.dtype is not dtype and x.is_floating_point() else x
        if type(x) in _SEQ:
            return _map_seq(x, lambda y: self.to_exact(y, dtype))
        return x


def _map_seq(x: list | tuple, fn: Callable[[Any], Any]) -> Any:
    """`type(x)(fn(y) for y in x)`, or `x` itself when fn changed nothing."""
    new = [fn(y) for y in x]
    for a, b in zip(new, x):
        if a is not b:
            return type(x)(new)
    return x


# --------------------------------------------------------------------------- wrappers

@dataclass
class WrapContext:
    """What a wrapper needs from its session, captured once at patch time."""

    caster: Caster
    half_dtype: torch.dtype
    counters: Counters
    allow_banned: bool
    timer: Any = None  # a callable(seconds) when timing telemetry is on


def _seq_needs(x: list | tuple, needs: frozenset) -> bool:
    """Whether a tensor in `x` (nested lists/tuples too) has a dtype in `needs`."""
    for y in x:
        if isinstance(y, _Tensor):
            if y.dtype in needs:
                return True
        elif type(y) in _SEQ and _seq_needs(y, needs):
            return True
    return False


def _cast_wrapper(original: Any, tick: Any, needs: frozenset, cast: Callable[[torch.Tensor], torch.Tensor],
                  seq: Callable[[Any], Any], timer: Callable[[float], None] | None) -> Callable:
    """The wrapper of a HALF or FLOAT op: a tensor whose dtype is in `needs` goes through
    `cast`; a list/tuple (or any other argument) through `seq`. One cheap pass decides
    whether anything needs a cast; when nothing does, the call goes straight to `wrapped`
    with the caller's own args (no tuple, list or dict is built). An empty kwargs dict is
    never passed on: `f(*args, **{})` costs a torch builtin about 0.25 us. With `timer`,
    the time spent converting is reported to it."""
    switch = _switch
    seq_needs = _seq_needs
    timed = timer is not None
    perf = time.perf_counter

    def convert_call(instance: Any, args: tuple, kwargs: dict) -> Any:
        if kwargs and _NOT_ELIGIBLE in kwargs:
            return original(*args, **kwargs) if instance is None else original(instance, *args, **kwargs)
        if timed:
            start = perf()
        out = [] if instance is None else [seq(instance)]  # `seq` converts any one argument
        for a in args:
            if isinstance(a, _Tensor):
                if a.dtype in needs:
                    a = cast(a)
            elif type(a) in _SEQ and seq_needs(a, needs):
                a = seq(a)
            out.append(a)
        new_kwargs = {k: (cast(v) if v.dtype in needs else v) if isinstance(v, _Tensor)
                      else seq(v) if type(v) in _SEQ else v for k, v in kwargs.items()} if kwargs else None
        if timed:
            timer(perf() - start)
        return original(*out, **new_kwargs) if new_kwargs else original(*out)

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not switch.enabled:
            return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
        next(tick)
        for a in args:
            if isinstance(a, _Tensor):
                if a.dtype in needs:
                    return convert_call(instance, args, kwargs)
            elif type(a) in _SEQ and seq_needs(a, needs):
                return convert_call(instance, args, kwargs)
        if instance is not None:
            if isinstance(instance, _Tensor):
                if instance.dtype in needs:
                    return convert_call(instance, args, kwargs)
            elif type(instance) in _SEQ and seq_needs(instance, needs):
                return convert_call(instance, args, kwargs)
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, _Tensor):
                    if v.dtype in needs:
                        return convert_call(instance, args, kwargs)
                elif type(v) in _SEQ and seq_needs(v, needs):
                    return convert_call(instance, args, kwargs)
            return wrapped(*args, **kwargs)
        return wrapped(*args)

    return wrapper


def make_wrapper(kind: str, op: str, original: Any, ctx: WrapContext, banned_message: str = "") -> Callable:
    """Build the wrapt wrapper function for one op of one kind.

    `original` is called unbound (`original(self, *args)`) for Tensor methods so that the
    tensor itself is cast too. With nothing to cast, the call goes to `wrapped` unchanged.
    """
    caster = ctx.caster
    if kind == BFLOAT16:
        kind, target = HALF, torch.bfloat16
    else:
        target = ctx.half_dtype
    switch = _switch
    timer = ctx.timer
    if kind == HALF:
        tick = ctx.counters.counter(op, str(target).removeprefix("torch."))
        to_half = caster.to_half
        return _cast_wrapper(original, tick, frozenset(CASTABLE) - {target}, caster.for_dtype(target),
                             lambda x: to_half(x, target), timer)
    if kind == FLOAT or (kind == BANNED and ctx.allow_banned):
        tick = ctx.counters.counter(op, "float32")
        return _cast_wrapper(original, tick, frozenset(LOW), caster.for_dtype(torch.float32), caster.to_float,
                             timer)
    if kind == CPU_FLOAT:
        on_cpu = make_wrapper(FLOAT, op, original, ctx)

        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            first = args[0] if args else instance
            if isinstance(first, _Tensor) and first.device.type != "cpu":
                return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
            return on_cpu(wrapped, instance, args, kwargs)
        return wrapper
    if kind in (PROMOTE, SEQUENCE_PROMOTE):
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
            # identity, never ==: comparing tensors with == is elementwise
            if (any(x is not y for x, y in zip(new_args, args))
                    or any(new_kwargs[k] is not v for k, v in kwargs.items())):
                next(counters.counter(op, str(dtype).removeprefix("torch.")))
            return new_args, new_kwargs
    elif kind == BANNED:
        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if any_low(args, kwargs):  # FP32 inputs are safe: nothing to protect, as in Apex
                raise NotImplementedError(banned_message)
            return args, kwargs
    else:
        raise ValueError(f"unknown cast kind {kind!r}")

    if timer is not None:  # report the time spent converting (not the op itself)
        untimed, perf = convert, time.perf_counter

        def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            start = perf()
            try:
                return untimed(args, kwargs)
            finally:
                timer(perf() - start)

    if kind in (PROMOTE, SEQUENCE_PROMOTE):
        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            if not switch.enabled:
                return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
            # Hot path: when every floating tensor argument has one dtype (an in-place op:
            # self's dtype, floating or not), promotion changes nothing and counts nothing,
            # so the call goes through untouched.
            full = args if instance is None else (instance, *args)
            first = full[0].dtype if in_place and full and isinstance(full[0], _Tensor) else None
            for a in itertools.chain(full, kwargs.values()) if kwargs else full:
                if isinstance(a, _Tensor):
                    d = a.dtype
                    if d.is_floating_point:
                        if first is None:
                            first = d
                        elif d is not first:
                            break
                elif type(a) in _SEQ:
                    break
            else:
                return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
            if kwargs and _NOT_ELIGIBLE in kwargs:
                return wrapped(*args, **kwargs)
            if instance is not None:
                args = (instance,) + args
            args, kwargs = convert(args, kwargs)
            return original(*args, **kwargs)
    else:
        def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            if not switch.enabled:
                return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
            if instance is not None:
                args = (instance,) + args
            args, kwargs = convert(args, kwargs)
            return original(*args, **kwargs)
    return wrapper


# --------------------------------------------------------------------------- torch.compile

def traced(fn: Callable) -> Callable:
    """Mark a function whose code (nested functions included) is meant for Dynamo to trace;
    the rest of ampatch's O1 code is kept out of compilation (see `ampatch.dynamo`)."""
    fn._ampatch_traced = True  # type: ignore[attr-defined]
    return fn


@traced
def make_traceable(kind: str, op: str, original: Any, half_dtype: torch.dtype, allow_banned: bool = False,
                   banned_message: str = "") -> Callable:
    """The wrapper of one op as plain Python that Dynamo can inline, so the casts it makes
    become nodes of the graph `torch.compile` captures (on every backend).

    Same policy as `make_wrapper`, written with ops Dynamo understands (`isinstance`, dtype
    tests, `Tensor.to`): no cast cache (the graph casts a weight once per use; the compiler
    merges repeated casts), no counters, no per-thread switch (the wrapper's
    `_torchdynamo_inline` picks this function or the original when Dynamo traces, and guards
    on that choice). `original` is called unbound for Tensor methods, as in `make_wrapper`.
    """
    if kind == BFLOAT16:
        kind, target = HALF, torch.bfloat16
    else:
        target = half_dtype
    if kind == BANNED and allow_banned:
        kind = FLOAT
    if kind == CPU_FLOAT:
        on_cpu = make_traceable(FLOAT, op, original, half_dtype)

        def traceable(*args: Any, **kwargs: Any) -> Any:
            if args and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu":
                return original(*args, **kwargs)
            return on_cpu(*args, **kwargs)
    elif kind in (HALF, FLOAT):
        if kind == HALF:
            needs = tuple(d for d in CASTABLE if d is not target)
        else:
            needs, target = LOW, torch.float32

        def conv(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return a.to(target) if a.dtype in needs else a
            if type(a) is list:
                return [conv(y) for y in a]
            if type(a) is tuple:
                return tuple([conv(y) for y in a])
            return a

        def traceable(*args: Any, **kwargs: Any) -> Any:
            if _NOT_ELIGIBLE in kwargs:
                return original(*args, **kwargs)
            return original(*[conv(a) for a in args], **{k: conv(v) for k, v in kwargs.items()})
    elif kind in (PROMOTE, SEQUENCE_PROMOTE):
        in_place = op.endswith("_") and not op.endswith("__")

        def widest_of(items: Any, found: Any) -> Any:
            for t in items:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    found = t.dtype if found is None else torch.promote_types(found, t.dtype)
                elif type(t) is list or type(t) is tuple:
                    found = widest_of(t, found)
            return found

        def to_exact(a: Any, dtype: torch.dtype) -> Any:
            if isinstance(a, torch.Tensor):
                return a.to(dtype) if a.is_floating_point() and a.dtype != dtype else a
            if type(a) is list:
                return [to_exact(y, dtype) for y in a]
            if type(a) is tuple:
                return tuple([to_exact(y, dtype) for y in a])
            return a

        def traceable(*args: Any, **kwargs: Any) -> Any:
            if in_place and args and isinstance(args[0], torch.Tensor):
                dtype = args[0].dtype
            else:
                dtype = widest_of(list(kwargs.values()), widest_of(args, None))
            if dtype is None or _NOT_ELIGIBLE in kwargs:
                return original(*args, **kwargs)
            return original(*[to_exact(a, dtype) for a in args], **{k: to_exact(v, dtype) for k, v in kwargs.items()})
    elif kind == BANNED:
        def low(a: Any) -> bool:
            if isinstance(a, torch.Tensor):
                return a.dtype in LOW
            if type(a) is list or type(a) is tuple:
                return any(low(y) for y in a)
            return False

        def traceable(*args: Any, **kwargs: Any) -> Any:
            if any(low(a) for a in args) or any(low(v) for v in kwargs.values()):
                raise NotImplementedError(banned_message)
            return original(*args, **kwargs)
    else:
        raise ValueError(f"unknown cast kind {kind!r}")
    traceable.__name__ = traceable.__qualname__ = f"ampatch_{kind}_{op}"
    return traceable


class _FunctionWrapper(wrapt.FunctionWrapper):
    """A `wrapt.FunctionWrapper` that `torch.compile` traces through.

    Dynamo takes a wrapt proxy of a torch builtin for that builtin (the proxy compares and
    hashes equal to it), so it would capture the original op and no cast. An object that
    carries `_torchdynamo_inline` is instead traced through that attribute (the convention
    `torch.jit.script` and `torch.compile` wrappers use): here, the wrapper's plain-Python
    twin from `make_traceable` while casts are on in the tracing thread, or the original op
    while they are off. Dynamo guards on the attribute, so a compiled graph is reused only
    under the same choice (a call inside `disable_casts()`, or after `deinitialize`,
    recompiles without the casts).
    """

    @property
    def _torchdynamo_inline(self) -> Any:
        if _switch.enabled:
            traceable = getattr(self, "_self_traceable", None)
            if traceable is not None:
                return traceable
        return self.__wrapped__


class _ModuleFunctionWrapper(_FunctionWrapper):
    """A `_FunctionWrapper` for a plain Python function that is a module attribute.

    wrapt labels a Python function's binding "function" and, on every call of an unbound
    wrapper, looks up a `__self__` such a function never has (an AttributeError raised and
    cleared per call, about half of wrapt's cost). A module attribute is never bound, so the
    "builtin" binding, which wrapt gives C functions, behaves the same and skips the lookup.
    """

    def __init__(self, wrapped: Any, wrapper: Callable) -> None:
        super(wrapt.FunctionWrapper, self).__init__(wrapped, None, wrapper, None, "builtin")


class _MethodWrapper(_FunctionWrapper):
    """A `_FunctionWrapper` for an instance method of a class (`torch.Tensor.softmax`).

    wrapt binds on every attribute access (`x.softmax` builds a bound method and a
    BoundFunctionWrapper); here the wrapper has the "builtin" binding and `__get__` returns a
    plain bound method of the wrapper, so `x.softmax(-1)` calls the wrapper with `instance`
    None and `x` as the first argument, exactly how the unbound original takes it (and how
    `torch.Tensor.softmax(x, -1)` calls it). Only for plain functions and method descriptors
    found in the class itself or its bases: never for static or class methods.
    """

    def __init__(self, wrapped: Any, wrapper: Callable) -> None:
        super(wrapt.FunctionWrapper, self).__init__(wrapped, None, wrapper, None, "builtin")

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return types.MethodType(self, instance)


def with_dtype_hint(wrapper: Callable, name: str) -> Callable:
    """`wrapper`, plus the registration hint of `tips` on a dtype-mismatch error that escapes
    it. Used for user code (registered and decorated functions), where such errors happen;
    the built-in ops cast so that they cannot, and keep their hot path free of the extra call."""
    def hinted(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return wrapper(wrapped, instance, args, kwargs)
        except (RuntimeError, TypeError, ValueError) as exc:
            hint_dtype_error(exc, name)
            raise
    return hinted


def wrap(kind: str, op: str, original: Any, ctx: WrapContext, banned_message: str = "",
         owner: Any = None, hint_name: str | None = None) -> wrapt.FunctionWrapper:
    """A wrapt FunctionWrapper around `original` (keeps its name, docs and identity checks),
    with its `torch.compile` twin (see `_FunctionWrapper`).

    `owner` is where it will be set (as attribute `op`): a Python function in a module, or an
    instance method of a class, gets a wrapper that skips wrapt's per-call binding work."""
    wrapper = make_wrapper(kind, op, original, ctx, banned_message)
    if hint_name is not None:
        wrapper = with_dtype_hint(wrapper, hint_name)
    cls: type[_FunctionWrapper] = _FunctionWrapper
    if isinstance(owner, types.ModuleType) and inspect.isfunction(original):
        cls = _ModuleFunctionWrapper
    elif isinstance(owner, type):
        try:
            raw = inspect.getattr_static(owner, op)
        except AttributeError:
            raw = None
        if raw is original and (inspect.isfunction(raw) or inspect.ismethoddescriptor(raw)) \
                and not isinstance(raw, (staticmethod, classmethod)):
            cls = _MethodWrapper
    try:
        proxy = cls(original, wrapper)
    except TypeError:  # a wrapt whose base constructor differs: the generic wrapper is fine
        proxy = _FunctionWrapper(original, wrapper)
    proxy._self_traceable = make_traceable(kind, op, original, ctx.half_dtype, ctx.allow_banned, banned_message)
    return proxy
