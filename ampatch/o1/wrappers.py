"""The eager O1 function of an op: its generated fast path (`o1.generate`) and its general
path, both from one `OpPlan`.

`make_function` gathers what the generated function closes over: the per-thread switch, the
converter (the dtype's own method), the session's cast cache (`WrapContext.inline`), the
op's counter, and the general path. The general path serves the calls the fast path hands
over (keywords to a builtin, containers, promotions that change something, refused dtypes,
`out=`): one walk over every argument with `map_tensors`, casting through the cache's caster
(`WrapContext.cast_for`).

A call counts in `report()`'s casts when it converted at least one argument; a call whose
arguments already had the target dtype counts nothing.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..base.counters import Counters
from ..base.dtypes import short_name
from ..base.patcher import cast_switch
from ..base.tree import ATOMS, map_tensors
from ..machine.tips import hint_dtype_error
from . import generate
from .cache import Inline, ParamCastCache, converter
from .plans import OUT, Action, OpPlan, off_cpu, promote_dtype
from .signatures import layout_of

Caster = Callable[[torch.Tensor], torch.Tensor]


class _NotGiven:
    """The default of a builtin's positional arguments in its O1 function: "not given"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<not given>"


NOT_GIVEN = _NotGiven()
_ATOMS = ATOMS | {_NotGiven}


class _Discard(dict):
    """The entries of a context without a cast cache: nothing stored, so never a hit."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


@dataclass
class WrapContext:
    """What a wrapper needs from its session, captured once at patch time."""

    cast_for: Callable[[torch.dtype], Caster]  # dtype -> its cast through the cache: `ParamCastCache.caster`
    half_dtype: torch.dtype
    counters: Counters
    allow_banned: bool
    timer: Callable[[float], None] | None = None  # given the seconds spent converting, when timing is on

    def inline(self, dtype: torch.dtype) -> Inline:
        """`ParamCastCache.inline(dtype)` of the cache behind `cast_for` (the O1 functions serve
        parameters inline); for any other `cast_for`, a cache that never hits nor keeps."""
        cache = getattr(self.cast_for, "__self__", None)
        if isinstance(cache, ParamCastCache):
            return cache.inline(dtype)
        entries = _Discard()
        return Inline(entries, entries.get, itertools.count(), itertools.count(), lambda t, key: None,
                      lambda t, key, cast: None)


def make_function(p: OpPlan, original: Any, ctx: WrapContext) -> Callable:
    """The O1 function of plan `p` around `original` (for a Tensor method: called unbound,
    `original(self, *args)`, so that the tensor itself is cast too)."""
    shape = generate.Shape(p.action, layout_of(original, generate.RESERVED), in_place=p.in_place,
                           cpu_only=p.cpu_only, timed=ctx.timer is not None)
    target = p.target if p.action is Action.CAST else None  # a CAST plan always has one
    tick = ctx.counters.counter(p.op, short_name(target)) if target is not None else None
    cast = ctx.cast_for(target) if target is not None else None
    leaf = p.leaf(cast) if cast is not None else None
    inline = ctx.inline(target) if target is not None else None
    values = generate.Values(
        op=original, switch=cast_switch, M=NOT_GIVEN, atoms=_ATOMS, Tensor=torch.Tensor, Parameter=torch.nn.Parameter,
        needs=p.needs, convert=converter(target) if target is not None else None, cache=inline,
        walk=(lambda x: map_tensors(x, leaf)) if leaf is not None else None,
        general=general_path(p, original, ctx, tick, cast), tick=tick,
        clock=time.perf_counter if ctx.timer is not None else None, timer=ctx.timer, off_cpu=off_cpu)
    return generate.build(shape, values, original)


def _given(args: tuple) -> tuple:
    """The positional arguments a call gave: a builtin's function hands over trailing
    NOT_GIVEN defaults."""
    end = len(args)
    while end and args[end - 1] is NOT_GIVEN:
        end -= 1
    return args if end == len(args) else args[:end]


def general_path(p: OpPlan, original: Any, ctx: WrapContext, tick: Any,
                 cast: Caster | None) -> Callable[[tuple, dict], Any]:
    """`(args, kwargs) -> result` for the calls the generated function hands over."""
    state, timer = cast_switch, ctx.timer
    perf = time.perf_counter

    def timed(start: float) -> None:
        if timer is not None:
            timer(perf() - start)

    if p.action is Action.CAST:
        leaf, cpu_only = p.leaf(cast), p.cpu_only

        def general(args: tuple, kwargs: dict) -> Any:
            args = _given(args)
            if not state.enabled or (kwargs and OUT in kwargs) or (cpu_only and args and off_cpu(args[0])):
                return original(*args, **kwargs)
            start = perf()
            new_args = map_tensors(args, leaf)
            new_kwargs = map_tensors(kwargs, leaf) if kwargs else kwargs
            timed(start)
            if new_args is not args or new_kwargs is not kwargs:
                next(tick)
            return original(*new_args, **new_kwargs)
        return general

    if p.action is Action.PROMOTE:
        in_place, op, counters, cast_for = p.in_place, p.op, ctx.counters, ctx.cast_for
        leaves: dict[torch.dtype, Callable] = {}  # per target dtype, made once

        def promote(args: tuple, kwargs: dict) -> Any:
            args = _given(args)
            if not state.enabled or (kwargs and OUT in kwargs):
                return original(*args, **kwargs)
            start = perf()
            dtype = promote_dtype(in_place, args, kwargs)
            if dtype is not None:
                leaf = leaves.get(dtype)
                if leaf is None:
                    leaf = leaves[dtype] = p.leaf(cast_for(dtype), dtype)
                new_args = map_tensors(args, leaf)
                new_kwargs = map_tensors(kwargs, leaf) if kwargs else kwargs
                if new_args is not args or new_kwargs is not kwargs:
                    next(counters.counter(op, short_name(dtype)))
                args, kwargs = new_args, new_kwargs
            timed(start)
            return original(*args, **kwargs)
        return promote

    refuse = p.leaf()

    def check(args: tuple, kwargs: dict) -> Any:
        args = _given(args)
        if state.enabled:
            start = perf()
            map_tensors(args, refuse)
            if kwargs:
                map_tensors(kwargs, refuse)
            timed(start)
        return original(*args, **kwargs)
    return check


def with_dtype_hint(fn: Callable, name: str) -> Callable:
    """`fn`, plus the registration hint of `tips` on a dtype-mismatch error that escapes it.
    Used for user code (registered and decorated functions), where such errors happen; the
    built-in ops cast so that they cannot, and keep their hot path free of the extra call."""
    def hinted(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError) as exc:
            hint_dtype_error(exc, name)
            raise
    for attr in ("__module__", "__name__", "__qualname__", "__doc__", "__wrapped__"):
        if hasattr(fn, attr):
            setattr(hinted, attr, getattr(fn, attr))
    return hinted
