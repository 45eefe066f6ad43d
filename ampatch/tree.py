"""One walk over argument structures, as `torch.autocast` has one `_cast`.

`map_tensors(x, leaf)` replaces every tensor nested in lists, tuples, namedtuples
(`PackedSequence` among them) and dicts by `leaf(tensor)`. Each caller brings its own leaf:
the O1 wrappers (a cast served from the cast cache), their `torch.compile` twins (`t.to`),
the RNN forward, promotion (which reads dtypes and changes nothing), and the model wrapper
of O2/O3/O5, which also converts custom batch objects through their `.to`.

Plain Python that Dynamo can inline: the twins call it while being traced.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch

Leaf = Callable[[torch.Tensor], Any]


def map_tensors(x: Any, leaf: Leaf, batch: Callable[[Any], Any] | None = None) -> Any:
    """`x` with each tensor `t` in it replaced by `leaf(t)`.

    The very same object comes back when nothing in it changed: a container is rebuilt
    (same type; a defaultdict keeps its factory) only around a change, so a caller tests
    `is` to learn whether anything was cast, and pays no copy when nothing was. With
    `batch`, any other object with a `.to` method (a custom batch; never a module or a
    string) becomes `batch(obj)`; without, it passes as it is, like numbers and None.
    """
    if isinstance(x, torch.Tensor):
        return leaf(x)
    cls = type(x)
    if cls is list or cls is tuple:  # first: what torch ops take
        new = [map_tensors(y, leaf, batch) for y in x]
        if _same(new, x):
            return x
        return new if cls is list else tuple(new)
    if isinstance(x, dict):
        items = [(k, map_tensors(v, leaf, batch)) for k, v in x.items()]
        if _same([v for _, v in items], x.values()):
            return x
        if isinstance(x, collections.defaultdict):  # its first constructor argument is the factory
            return cls(x.default_factory, items)
        return cls(items)
    if isinstance(x, (list, tuple)):
        new = [map_tensors(y, leaf, batch) for y in x]
        if _same(new, x):
            return x
        return cls(*new) if hasattr(x, "_fields") else cls(new)  # a namedtuple takes fields
    if batch is not None and not isinstance(x, (str, bytes, torch.nn.Module)) and callable(getattr(x, "to", None)):
        return batch(x)
    return x


def _same(new: list, old: Iterable) -> bool:
    """Whether every item of `new` is the very object at its place in `old` (identity,
    never ==: comparing tensors with == is elementwise)."""
    for a, b in zip(new, old):
        if a is not b:
            return False
    return True
