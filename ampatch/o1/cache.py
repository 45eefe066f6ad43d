"""The per-iteration cast cache: each parameter is cast to a given dtype once, then reused.

Only parameters (`nn.Parameter`s that require grad) are cached, as in Apex: activations
change every call, and a leaf activation that requires grad (the detached input of a
reentrant `torch.utils.checkpoint` segment, an input given `requires_grad=True`) fed to
several ops would share one cast, so their gradients would be summed in half precision
before reaching it, instead of in FP32 as without checkpointing. An entry is valid while the parameter is at the same version (an in-place update
such as `optimizer.step()` bumps `_version`), its `.data` has not been touched since (see
`watch_data`: `p.data.copy_(...)`, `p.data = ...` and `vector_to_parameters` change a
parameter without a version bump), and, when gradients are needed now, only if the cast
itself was made with gradients enabled. The session clears it on `scale_loss` exit and
after every optimizer step.

Entries hold their parameter weakly: when a parameter is freed (a dropped model), its
entries go with it, and a cast made without gradients (inference, evaluation) with them.
A cast made with gradients refers to its parameter through its autograd graph, so it lives
until the next `scale_loss` exit, optimizer step, or `deinitialize`. A parameter's id is
thus never reused while its entry exists, which is what makes an id lookup enough.

Safe under threads: entries are added, replaced and removed by single dict operations; a
race makes two threads both cast and one entry win, never a wrong answer.

Hot path: the wrappers call a per-dtype closure from `caster(dtype)` (everything it needs
bound as locals), and plain tensors and parameters are converted with the dtype's own
method (`t.bfloat16()`), which parses its arguments faster than `t.to(dtype)` (1.5 us
against 2.4 us) and does the same thing; other tensor subclasses keep going through
`t.to(dtype)`, whatever they override.
"""
from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..base.counters import count_value

_grad_enabled = torch.is_grad_enabled
_TensorBase = torch._C.TensorBase

_CONVERTERS: dict[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] = {
    torch.float16: _TensorBase.half,
    torch.bfloat16: _TensorBase.bfloat16,
    torch.float32: _TensorBase.float,
    torch.float64: _TensorBase.double,
}
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: their `.to` is TensorBase's


class CastCache:
    """Maps id(param) -> (weakref to param, version, made_with_grad, cast) per target dtype."""

    __slots__ = ("_maps", "_hits", "_misses", "_casters", "__weakref__")

    def __init__(self) -> None:
        self._maps: dict[torch.dtype, dict[int, tuple]] = {
            torch.float16: {}, torch.bfloat16: {}, torch.float32: {}, torch.float64: {}}
        self._hits = itertools.count()
        self._misses = itertools.count()
        self._casters: dict[torch.dtype, Callable[[torch.Tensor], torch.Tensor]] = {}

    def caster(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """`t.to(dtype)` served from the cache for parameters: a closure specialised for one
        dtype, made once per dtype."""
        fn = self._casters.get(dtype)
        if fn is not None:
            return fn
        entries = self._maps.setdefault(dtype, {})
        fast = _CONVERTERS.get(dtype)
        plain = _PLAIN if fast is not None else ()
        hits, misses = self._hits, self._misses
        grad_enabled = _grad_enabled
        parameter = torch.nn.Parameter
        ref = weakref.ref
        drop = entries.pop

        def fn(t: torch.Tensor) -> torch.Tensor:
            # The lookup comes first: only a cached parameter can hit, and the checks after
            # it are exactly the ones that decide whether a cast may be cached at all.
            key = id(t)
            entry = entries.get(key)
            if (entry is not None and t.requires_grad and entry[1] == t._version
                    and (entry[2] or not grad_enabled())):
                next(hits)
                return entry[3]
            if t.requires_grad and isinstance(t, parameter) and t.is_leaf:
                next(misses)
                out = fast(t) if type(t) in plain else t.to(dtype)
                entries[key] = (ref(t, lambda _, key=key: drop(key, None)), t._version, grad_enabled(), out)
                return out
            return fast(t) if type(t) in plain else t.to(dtype)

        self._casters[dtype] = fn
        return fn

    def forget(self, t: torch.Tensor) -> None:
        """Drop the casts of one tensor (its contents are about to change unseen)."""
        key = id(t)
        for entries in self._maps.values():
            entries.pop(key, None)

    def clear(self) -> None:
        """Forget every cast (end of an iteration)."""
        for entries in self._maps.values():
            if entries:
                entries.clear()

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps.values())

    @property
    def hits(self) -> int:
        return count_value(self._hits)

    @property
    def misses(self) -> int:
        return count_value(self._misses)


def watch_data(cache: CastCache, patcher: Any) -> None:
    """Make `Tensor.data` drop the tensor's cached casts when it is read or assigned.

    `p.data` is the one common way to change a parameter that autograd does not see:
    `p.data.copy_(ema)` or `p.data = ...` (as `vector_to_parameters` and `Module._apply`
    do) leave `p._version` as it was, so the cache could not tell. Reading `.data` is
    where each of them starts; the property forwards to torch's own descriptor. (A `.data`
    alias kept from before the cast, or writes through numpy, stay invisible.)
    """
    descriptor = vars(torch._C.TensorBase)["data"]
    get, put = descriptor.__get__, descriptor.__set__
    forget = weakref.WeakMethod(cache.forget)  # the property must not keep a closed session alive

    def data(self: torch.Tensor) -> torch.Tensor:
        f = forget()
        if f is not None:
            f(self)
        return get(self)

    def set_data(self: torch.Tensor, value: torch.Tensor) -> None:
        f = forget()
        if f is not None:
            f(self)
        put(self, value)

    patcher.patch(torch.Tensor, "data", property(data, set_data, doc=descriptor.__doc__))
