"""`apex.amp.compat`: Apex's helpers for old PyTorch versions (Variable vs Tensor), answered
for current PyTorch, where every Variable is a Tensor."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["variable_is_tensor", "tensor_is_variable", "tensor_is_float_tensor", "is_tensor_like",
           "is_floating_point", "scalar_python_val", "filter_attrs"]


def variable_is_tensor() -> bool:
    return True


def tensor_is_variable() -> bool:
    return True


def tensor_is_float_tensor() -> bool:
    return True


def is_tensor_like(x: Any) -> bool:
    return torch.is_tensor(x)


def is_floating_point(x: Any) -> bool:
    """Whether `x` is a floating tensor (any floating dtype)."""
    return torch.is_tensor(x) and x.is_floating_point()


def scalar_python_val(x: Any) -> Any:
    """A one-element tensor (or a number) as a Python number."""
    return x.item() if hasattr(x, "item") else x


def filter_attrs(module: Any, attrs: Iterable[str]) -> list[str]:
    """The names in `attrs` that `module` has."""
    return [a for a in attrs if hasattr(module, a)]
