"""One walk over argument structures, as `torch.autocast` has one `_cast`.

`map_tensors(x, leaf)` replaces every tensor nested in lists, tuples, namedtuples
(`PackedSequence` among them) and dicts by `leaf(tensor)`; `holds_dtype(x, dtypes)` is
the same walk asking only whether one of those tensors has a dtype in `dtypes` (the O1
wrappers' pre-check: nothing built, no call per tensor). Each caller brings its own leaf:
the O1 wrappers (a cast served from the cast cache), their `torch.compile` twins (`t.to`),
the RNN forward, promotion (which reads dtypes and changes nothing), and the model wrapper
of O2/O3/O5, which also converts custom batch objects through their `.to`.

Plain Python that Dynamo can inline: the twins call it while being traced. It runs on the
O1 hot path too, so it makes as few Python calls as it can: none per tensor or `ATOMS`
item of a container.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

import torch

Leaf = Callable[[torch.Tensor], Any]

# Argument types that never hold a tensor: a walk (and the wrappers' pre-checks) passes them
# without a look.
ATOMS = frozenset({int, float, bool, complex, str, bytes, type(None), type(Ellipsis), slice,
                   torch.dtype, torch.device, torch.Size, torch.layout, torch.memory_format})

CONTAINERS = (list, tuple, dict)  # what the walks look into (namedtuples are tuples; a dict's values)

_Tensor = torch.Tensor


def map_tensors(x: Any, leaf: Leaf, batch: Callable[[Any], Any] | None = None) -> Any:
    """`x` with each tensor `t` in it replaced by `leaf(t)`.

    The very same object comes back when nothing in it changed: a container is rebuilt
    (same type; a defaultdict keeps its factory) only around a change, so a caller tests
    `is` to learn whether anything was cast, and pays no copy when nothing was. With
    `batch`, any other object with a `.to` method (a custom batch; never a module or a
    string) becomes `batch(obj)`; without, it passes as it is, like numbers and None.
    """
    if isinstance(x, _Tensor):
        return leaf(x)
    items: Iterable[Any]
    if isinstance(x, dict):
        items = x.values()
    elif isinstance(x, (list, tuple)):
        items = x
    elif batch is not None and type(x) not in ATOMS and not isinstance(x, torch.nn.Module) \
            and callable(getattr(x, "to", None)):
        return batch(x)
    else:
        return x
    new = []
    changed = False
    for y in items:
        if isinstance(y, _Tensor):
            z = leaf(y)
        elif type(y) in ATOMS:
            z = y
        else:
            z = map_tensors(y, leaf, batch)
        if z is not y:  # identity, never ==: comparing tensors with == is elementwise
            changed = True
        new.append(z)
    return _rebuild(x, new) if changed else x


def holds_dtype(x: Any, dtypes: frozenset) -> bool:
    """Whether a tensor nested in the container `x` (as `map_tensors` walks it) has a dtype
    in `dtypes`; False for anything but a container (a tensor itself included: callers test
    a tensor argument inline, before calling this)."""
    cls = type(x)
    if cls is not tuple and cls is not list:
        if isinstance(x, dict):
            x = x.values()
        elif not isinstance(x, (list, tuple)):
            return False
    for y in x:
        if isinstance(y, _Tensor):
            if y.dtype in dtypes:
                return True
        elif type(y) not in ATOMS and holds_dtype(y, dtypes):
            return True
    return False


def _rebuild(x: Any, new: list) -> Any:
    """A container of `x`'s type holding `new` (in the order `map_tensors` visited)."""
    cls = type(x)
    if cls is list:
        return new
    if cls is tuple:
        return tuple(new)
    if isinstance(x, dict):
        items = list(zip(x.keys(), new))
        if isinstance(x, collections.defaultdict):  # its first constructor argument is the factory
            return cls(x.default_factory, items)
        return cls(items)
    return cls(*new) if hasattr(x, "_fields") else cls(new)  # a namedtuple takes its fields
