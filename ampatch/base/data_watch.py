"""Writes through `Tensor.data` (`p.data.clamp_(...)`, `p.data = ...`) move no version
counter, so whoever keeps a second copy of a tensor cannot see them: `watch_data` makes
`torch.Tensor.data` call back with the tensor each time it is read or assigned, through a
`Patcher` (undone with everything else). `raw_data` / `set_data` are torch's own access,
for ampatch's reads and writes, which are no user's.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["TENSOR_DATA", "raw_data", "set_data", "watch_data"]

TENSOR_DATA = vars(torch._C.TensorBase)["data"]  # the C getset `Tensor.data`


def raw_data(t: torch.Tensor) -> torch.Tensor:
    """`t.data` as torch gives it, past any watch."""
    return TENSOR_DATA.__get__(t)


def set_data(t: torch.Tensor, value: torch.Tensor) -> None:
    """`t.data = value` as torch does it, past any watch."""
    TENSOR_DATA.__set__(t, value)


def watch_data(patcher, touched: Callable[[torch.Tensor], None]) -> None:
    """From now until `patcher` restores torch, `touched(t)` runs before each read or
    assignment of `t.data` (any tensor: `touched` picks its own)."""
    get, put = TENSOR_DATA.__get__, TENSOR_DATA.__set__

    def data(self: torch.Tensor) -> torch.Tensor:
        touched(self)
        return get(self)

    def assign(self: torch.Tensor, value: torch.Tensor) -> None:
        touched(self)
        put(self, value)

    patcher.patch(torch.Tensor, "data", property(data, assign, doc=TENSOR_DATA.__doc__))
