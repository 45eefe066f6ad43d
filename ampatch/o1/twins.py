"""The `torch.compile` twins: each O1 wrapper's plan as plain Python that Dynamo inlines,
so the casts it makes become nodes of the graph `torch.compile` captures (on every backend).

A twin reads the same `OpPlan` as the eager wrapper and walks arguments with the same
`map_tensors`, with ops Dynamo understands (`isinstance`, dtype tests, `Tensor.to`): no
cast cache (the graph casts a weight once per use; the compiler merges repeated casts), no
counters, no per-thread switch (the O1 function's `_torchdynamo_inline` picks the twin or
the original when Dynamo traces, and guards on that choice; see `proxies`).

The rest of ampatch's O1 code is kept out of compilation (`ampatch.o1.dynamo`); code meant for
Dynamo to trace is marked with `traced` and recognised with `is_traced`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..base.tree import map_tensors
from .plans import OUT, Action, OpPlan, off_cpu, promote_dtype

_TRACED = "_ampatch_traced"


def traced(fn: Callable) -> Callable:
    """Mark a function whose code (nested functions included) is meant for Dynamo to trace."""
    setattr(fn, _TRACED, True)
    return fn


def is_traced(obj: Any) -> bool:
    """Whether `obj` was marked with `traced`."""
    return getattr(obj, _TRACED, False) is True


@traced
def make_traceable(p: OpPlan, original: Any) -> Callable:
    """The twin of plan `p` around `original` (called unbound for Tensor methods, as the
    eager wrapper calls it)."""
    if p.action is Action.CAST:
        target, cpu_only = p.target, p.cpu_only
        leaf = p.leaf(lambda t: t.to(target))

        def traceable(*args: Any, **kwargs: Any) -> Any:
            if OUT in kwargs or (cpu_only and args and off_cpu(args[0])):
                return original(*args, **kwargs)
            return original(*map_tensors(args, leaf), **map_tensors(kwargs, leaf))
    elif p.action is Action.PROMOTE:
        in_place = p.in_place

        def traceable(*args: Any, **kwargs: Any) -> Any:
            dtype = promote_dtype(in_place, args, kwargs)
            if dtype is None or OUT in kwargs:
                return original(*args, **kwargs)

            leaf = p.leaf(lambda t: t.to(dtype), dtype)
            return original(*map_tensors(args, leaf), **map_tensors(kwargs, leaf))
    else:
        refuse = p.leaf()

        def traceable(*args: Any, **kwargs: Any) -> Any:
            map_tensors(args, refuse)
            map_tensors(kwargs, refuse)
            return original(*args, **kwargs)
    traceable.__name__ = traceable.__qualname__ = f"ampatch_{p.kind.value}_{p.op}"
    return traceable
