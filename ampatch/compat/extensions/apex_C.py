"""`apex_C` under the alias: Apex's compiled `flatten`/`unflatten` helpers, which are
torch's own dense-tensor flattening."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

__all__ = ["flatten", "unflatten"]


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' elements, in order, in one new 1-D tensor (of their common dtype)."""
    return _flatten_dense_tensors(list(tensors))


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of `flat` shaped like `tensors`, in order (the inverse of `flatten`)."""
    return _unflatten_dense_tensors(flat, list(tensors))
