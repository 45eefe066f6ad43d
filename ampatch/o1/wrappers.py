"""The eager O1 wrappers: wrapt wrapper functions built from a `CastPlan`, on every call's
hot path.

Each reads its plan once, at build time, into locals. A CAST wrapper first makes one cheap
pass over the arguments, and when no tensor has a dtype the plan casts, calls the op with
the caller's own arguments (no tuple, list or dict is built); a PROMOTE wrapper likewise
when every floating tensor has one dtype. Only then does `map_tensors` rebuild arguments.
Casts go through the session's cast cache (`WrapContext.cast_for`), so a parameter is cast
once per iteration.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from ..base.dtypes import short_name
from ..base.counters import Counters
from ..machine.tips import hint_dtype_error
from ..base.tree import ATOMS, CONTAINERS, holds_dtype, map_tensors
from .plans import OUT, Action, CastPlan, off_cpu, promote_dtype
from ..base.patcher import cast_switch

Caster = Callable[[torch.Tensor], torch.Tensor]
_Tensor = torch.Tensor


@dataclass
class WrapContext:
    """What a wrapper needs from its session, captured once at patch time."""

    cast_for: Callable[[torch.dtype], Caster]  # dtype -> its cast through the cache (`CastCache.caster`)
    half_dtype: torch.dtype
    counters: Counters
    allow_banned: bool
    timer: Callable[[float], None] | None = None  # given the seconds spent converting, when timing is on


def make_wrapper(p: CastPlan, original: Any, ctx: WrapContext) -> Callable:
    """The wrapt wrapper function of plan `p` around `original`.

    `original` is called unbound (`original(self, *args)`) for Tensor methods so that the
    tensor itself is cast too. With nothing to cast, the call goes to `wrapped` unchanged.
    """
    if p.action is Action.CAST:
        wrapper = _cast_wrapper(p, original, ctx.counters.counter(p.op, p.label), ctx.cast_for(p.target), ctx.timer)
        return _on_cpu_only(wrapper) if p.cpu_only else wrapper
    if p.action is Action.PROMOTE:
        return _promote_wrapper(p, original, ctx)
    return _refuse_wrapper(p, original, ctx.timer)


def _cast_wrapper(p: CastPlan, original: Any, tick: Any, cast: Caster,
                  timer: Callable[[float], None] | None) -> Callable:
    """A CAST wrapper: a tensor whose dtype is in the plan's `needs` goes through `cast`
    (inline for a tensor argument, through the plan's leaf in containers). An empty kwargs
    dict is never passed on: `f(*args, **{})` costs a torch builtin about 0.25 us. With
    `timer`, the time spent converting is reported."""
    state = cast_switch
    holds, atoms = holds_dtype, ATOMS
    timed = timer is not None
    perf = time.perf_counter
    needs, leaf = p.needs, p.leaf(cast)

    def convert_call(instance: Any, args: tuple, kwargs: dict) -> Any:
        if kwargs and OUT in kwargs:
            return original(*args, **kwargs) if instance is None else original(instance, *args, **kwargs)
        if timed:
            start = perf()
        out = [] if instance is None else [map_tensors(instance, leaf)]
        for a in args:
            if isinstance(a, _Tensor):
                if a.dtype in needs:
                    a = cast(a)
            elif type(a) not in atoms and holds(a, needs):
                a = map_tensors(a, leaf)
            out.append(a)
        new_kwargs = map_tensors(kwargs, leaf) if kwargs else None
        if timed:
            timer(perf() - start)
        return original(*out, **new_kwargs) if new_kwargs else original(*out)

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not state.enabled:
            return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
        next(tick)
        for a in args:
            if isinstance(a, _Tensor):
                if a.dtype in needs:
                    return convert_call(instance, args, kwargs)
            elif type(a) not in atoms and holds(a, needs):
                return convert_call(instance, args, kwargs)
        if instance is not None:
            if isinstance(instance, _Tensor):
                if instance.dtype in needs:
                    return convert_call(instance, args, kwargs)
            elif holds(instance, needs):
                return convert_call(instance, args, kwargs)
        if kwargs:
            for v in kwargs.values():
                if isinstance(v, _Tensor):
                    if v.dtype in needs:
                        return convert_call(instance, args, kwargs)
                elif type(v) not in atoms and holds(v, needs):
                    return convert_call(instance, args, kwargs)
            return wrapped(*args, **kwargs)
        return wrapped(*args)

    return wrapper


def _on_cpu_only(wrapper: Callable) -> Callable:
    """`wrapper` for calls whose first tensor is on the CPU; others go to `wrapped` as they are."""
    def on_cpu(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if off_cpu(args[0] if args else instance):
            return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
        return wrapper(wrapped, instance, args, kwargs)
    return on_cpu


def _timed(convert: Callable, timer: Callable[[float], None] | None) -> Callable:
    """`convert`, reporting the seconds it takes to `timer` (when timing is on)."""
    if timer is None:
        return convert
    perf = time.perf_counter

    def timed(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        start = perf()
        try:
            return convert(args, kwargs)
        finally:
            timer(perf() - start)
    return timed


def _promote_wrapper(p: CastPlan, original: Any, ctx: WrapContext) -> Callable:
    """A PROMOTE wrapper: floating tensors to `promote_dtype`'s choice, counted per dtype
    when something was cast."""
    state = cast_switch
    atoms = ATOMS
    in_place, op, counters, cast_for = p.in_place, p.op, ctx.counters, ctx.cast_for
    leaves: dict[torch.dtype, Callable] = {}  # per target dtype, made once

    def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        dtype = promote_dtype(in_place, args, kwargs)
        if dtype is None:
            return args, kwargs
        leaf = leaves.get(dtype)
        if leaf is None:
            leaf = leaves[dtype] = p.leaf(cast_for(dtype), dtype)
        new_args = map_tensors(args, leaf)
        new_kwargs = map_tensors(kwargs, leaf) if kwargs else kwargs
        if new_args is not args or new_kwargs is not kwargs:
            next(counters.counter(op, short_name(dtype)))
        return new_args, new_kwargs

    convert = _timed(convert, ctx.timer)

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not state.enabled:
            return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
        # Hot path: when every floating tensor argument has one dtype (an in-place op:
        # self's dtype, floating or not), promotion changes nothing and counts nothing,
        # so the call goes through untouched.
        full = args if instance is None else (instance, *args)
        first = full[0].dtype if in_place and full and isinstance(full[0], _Tensor) else None
        for a in chain(full, kwargs.values()) if kwargs else full:
            if isinstance(a, _Tensor):
                d = a.dtype
                if d.is_floating_point:
                    if first is None:
                        first = d
                    elif d is not first:
                        break
            elif type(a) not in atoms and isinstance(a, CONTAINERS):
                break
        else:
            return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
        if kwargs and OUT in kwargs:
            return wrapped(*args, **kwargs)
        args, kwargs = convert(full, kwargs)
        return original(*args, **kwargs)

    return wrapper


def _refuse_wrapper(p: CastPlan, original: Any, timer: Callable[[float], None] | None) -> Callable:
    """A REFUSE wrapper (a banned op): a tensor whose dtype is in `needs` raises, with the
    plan's message naming the safe alternative; FP32 calls run."""
    state = cast_switch
    refuse = p.leaf()

    def check(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        map_tensors(args, refuse)
        if kwargs:
            map_tensors(kwargs, refuse)
        return args, kwargs

    check = _timed(check, timer)

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        if not state.enabled:
            return wrapped(*args, **kwargs) if kwargs else wrapped(*args)
        if instance is not None:
            args = (instance,) + args
        args, kwargs = check(args, kwargs)
        return original(*args, **kwargs)

    return wrapper


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
