"""The per-iteration cast cache: each trained parameter is cast to a given dtype once, then reused.

Only parameters (`nn.Parameter`s that require grad) are cached, as in Apex: activations
change every call, and a leaf activation that requires grad (the detached input of a
reentrant `torch.utils.checkpoint` segment, an input given `requires_grad=True`) fed to
several ops would share one cast, so their gradients would be summed in half precision
before reaching it, instead of in FP32 as without checkpointing. The O1 functions
(`o1.generate`) send only parameters here: plain tensors never pay for a lookup.

One dict per target dtype, keyed by the parameter's id:

- `id(p)` -> `(version, cast)`: a cast made with gradients enabled. Its autograd graph holds
  the parameter, so the id cannot be reused while the entry exists; valid in any grad mode.
- `~id(p)` -> `(version, cast, ref)`: a cast made without gradients (evaluation, inference),
  never served when gradients are needed (train -> eval -> train works). `ref` is a weak
  reference whose callback drops the entry when the parameter is freed: a dropped model
  takes its casts with it.

An entry is valid while the parameter is at the version it was cast at (an in-place update
such as `optimizer.step()` bumps `_version`) and its `.data` has not been touched since (see
`watch_data`: `p.data.copy_(...)`, `p.data = ...` and `vector_to_parameters` change a
parameter without a version bump). So a hit is a dict lookup and a version compare. The
session clears the cache on `scale_loss` exit and after every optimizer step.

Counting stays off the miss path: a hit is one atomic `next()`; each miss stores one entry,
so misses are the entries stored, settled in bulk when entries go (`clear`, `forget`, a freed
parameter, a stale entry replaced).

Safe under threads: entries are added, replaced and removed by single dict operations; a
race makes two threads both cast and one entry win, never a wrong answer.

Plain tensors and parameters are converted with the dtype's own method (`t.bfloat16()`),
which parses its arguments faster than `t.to(dtype)` and does the same thing; other tensor
subclasses keep going through `t.to(dtype)`, whatever they override.
"""
from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from ..base import patcher as torch_patches
from ..base.counters import count_value

__all__ = ["ParamCastCache", "Inline", "converter", "watch_data"]

Cast = Callable[[torch.Tensor], torch.Tensor]

_TensorBase = torch._C.TensorBase
_CONVERTERS: dict[torch.dtype, Cast] = {
    torch.float16: _TensorBase.half,
    torch.bfloat16: _TensorBase.bfloat16,
    torch.float32: _TensorBase.float,
    torch.float64: _TensorBase.double,
}
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exact types: their conversion methods are TensorBase's


def converter(dtype: torch.dtype) -> Cast:
    """The fastest exact cast to `dtype` of a plain tensor or parameter (exact types only)."""
    fast = _CONVERTERS.get(dtype)
    return fast if fast is not None else (lambda t: t.to(dtype))


class Inline(NamedTuple):
    """A cache's casts to one dtype, for an O1 function that serves parameters inline.

    For a parameter `p` that requires grad, `entry = get(id(p))` is its cast made with
    gradients, `(version, cast)`: a hit while `entry[0] == p._version` (count it: `next(hits)`).
    On a miss with gradients enabled, store `entries[id(p)] = (p._version, cast)`, after
    `next(stale)` if `entry` was not None. Without gradients, `no_grad_get(p, id(p))` is a
    cached no-grad cast or None, and `no_grad_put(p, id(p), cast)` caches a new one."""

    entries: dict[int, tuple]
    get: Callable[[int], tuple | None]
    hits: Any
    stale: Any
    no_grad_get: Callable[[torch.Tensor, int], torch.Tensor | None]
    no_grad_put: Callable[[torch.Tensor, int, torch.Tensor], None]


class ParamCastCache:
    """Casts of parameters per target dtype (see the module doc)."""

    __slots__ = ("_maps", "_casters", "_inline", "_hits", "_stale", "_gone", "_settled", "_lock", "__weakref__")

    def __init__(self) -> None:
        self._maps: dict[torch.dtype, dict[int, tuple]] = {}
        self._casters: dict[torch.dtype, Cast] = {}
        self._inline: dict[torch.dtype, Inline] = {}
        self._hits = itertools.count()
        self._stale = itertools.count()  # entries replaced because their parameter changed
        self._gone = itertools.count()   # entries dropped one by one (forget, a freed parameter)
        self._settled = 0                # entries dropped by clear()
        self._lock = threading.Lock()

    def caster(self, dtype: torch.dtype) -> Cast:
        """`t.to(dtype)` for a tensor whose dtype is not `dtype`, served from the cache for
        parameters: a closure specialised for one dtype, made once per dtype."""
        fn = self._casters.get(dtype)
        if fn is None:
            fn = self._casters[dtype] = self._make_caster(dtype)
        return fn

    def inline(self, dtype: torch.dtype) -> Inline:
        """What an O1 function needs to serve parameters' casts to `dtype` inline (see `Inline`)."""
        self.caster(dtype)
        return self._inline[dtype]

    def _make_caster(self, dtype: torch.dtype) -> Cast:
        entries = self._maps.setdefault(dtype, {})
        get = entries.get
        fast = converter(dtype)  # used only where `plain` matches: the exact types with a conversion method
        plain = _PLAIN if dtype in _CONVERTERS else ()
        hits, stale, gone = self._hits, self._stale, self._gone
        grad_enabled = torch.is_grad_enabled
        parameter = torch.nn.Parameter
        keyed_ref = weakref.KeyedRef

        def dead(ref: weakref.KeyedRef) -> None:  # a parameter with a no-grad cast was freed
            if entries.pop(ref.key, None) is not None:
                next(gone)

        def no_grad_get(t: torch.Tensor, key: int) -> torch.Tensor | None:
            entry = get(~key)
            if entry is not None and entry[0] == t._version:
                next(hits)
                return entry[1]
            return None

        def no_grad_put(t: torch.Tensor, key: int, out: torch.Tensor) -> None:
            if ~key in entries:
                next(stale)
            entries[~key] = (t._version, out, keyed_ref(t, dead, ~key))

        def convert(t: torch.Tensor) -> torch.Tensor:
            return fast(t) if type(t) in plain else t.to(dtype)

        def cast(t: torch.Tensor) -> torch.Tensor:
            if not (t.requires_grad and (type(t) is parameter or (isinstance(t, parameter) and t.is_leaf))):
                return convert(t)
            key = id(t)
            entry = get(key)
            if entry is not None and entry[0] == t._version:
                next(hits)
                return entry[1]
            grad = grad_enabled()
            out = None if grad else no_grad_get(t, key)
            if out is None:
                out = convert(t)  # one line for both grad modes: torch.jit.trace's check compares lines
                if not grad:
                    no_grad_put(t, key, out)
                else:
                    if entry is not None:
                        next(stale)
                    entries[key] = (t._version, out)
            return out

        self._inline[dtype] = Inline(entries, get, hits, stale, no_grad_get, no_grad_put)
        return cast

    def forget(self, t: torch.Tensor) -> None:
        """Drop the casts of one tensor (its contents are about to change unseen)."""
        key = id(t)
        for entries in self._maps.values():
            for k in (key, ~key):
                if entries.pop(k, None) is not None:
                    next(self._gone)

    def clear(self) -> None:
        """Forget every cast (end of an iteration)."""
        with self._lock:
            for entries in self._maps.values():
                if entries:
                    self._settled += len(entries)
                    entries.clear()

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps.values())

    @property
    def hits(self) -> int:
        return count_value(self._hits)

    @property
    def misses(self) -> int:
        """Casts made and cached: one entry stored per miss."""
        return self._settled + count_value(self._gone) + count_value(self._stale) + len(self)


def watch_data(cache: ParamCastCache, patcher: Any) -> None:
    """Make `Tensor.data` drop the tensor's cached casts when it is read or assigned.

    `p.data` is the one common way to change a parameter that autograd does not see:
    `p.data.copy_(ema)` or `p.data = ...` (as `vector_to_parameters` and `Module._apply`
    do) leave `p._version` as it was, so the cache could not tell. Reading `.data` is
    where each of them starts (`base.patcher.watch_data`). (A `.data` alias kept from before the
    cast, or writes through numpy, stay invisible.)
    """
    forget = weakref.WeakMethod(cache.forget)  # the watch must not keep a closed session alive

    def touched(t: torch.Tensor) -> None:
        f = forget()
        if f is not None:
            f(t)

    torch_patches.watch_data(patcher, touched)
