"""The per-iteration cast cache: each parameter is cast to a given dtype once, then reused.

Only leaf tensors that require grad (parameters) are cached: activations change every
call. An entry is valid while the parameter is the same object at the same version
(an in-place update such as `optimizer.step()` bumps `_version`) and, when gradients are
needed now, only if the cast itself was made with gradients enabled. The session clears
it on `scale_loss` exit and after every optimizer step. Safe under threads: a race makes
two threads both cast and one entry win, never a wrong answer.
"""
from __future__ import annotations

import itertools

import torch

_grad_enabled = torch.is_grad_enabled


class CastCache:
    """Maps id(param) -> (param, version, made_with_grad, cast) per target dtype."""

    __slots__ = ("_maps", "_hits", "_misses", "enabled")

    def __init__(self, enabled: bool = True) -> None:
        self._maps: dict[torch.dtype, dict[int, tuple]] = {
            torch.float16: {}, torch.bfloat16: {}, torch.float32: {}, torch.float64: {}}
        self._hits = itertools.count()
        self._misses = itertools.count()
        self.enabled = enabled

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`t.to(dtype)`, served from the cache for parameters."""
        if not (self.enabled and t.requires_grad and t.is_leaf):
            return t.to(dtype)
        entries = self._maps[dtype]
        entry = entries.get(id(t))
        if (entry is not None and entry[0] is t and entry[1] == t._version
                and (entry[2] or not _grad_enabled())):
            next(self._hits)
            return entry[3]
        next(self._misses)
        out = t.to(dtype)
        entries[id(t)] = (t, t._version, _grad_enabled(), out)
        return out

    def clear(self) -> None:
        """Forget every cast (end of an iteration)."""
        for entries in self._maps.values():
            entries.clear()

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps.values())

    @property
    def hits(self) -> int:
        return self._hits.__reduce__()[1][0]

    @property
    def misses(self) -> int:
        return self._misses.__reduce__()[1][0]
