"""The floating dtypes mixed precision deals in, defined once.

`LOW` are the half-precision dtypes (what the O1 wrappers cast to and back from, what a
cast model holds); `CASTABLE` the dtypes a cast to half may start from (never float64:
double is a deliberate choice that casts leave alone).
"""
from __future__ import annotations

from typing import overload

import torch

__all__ = ["LOW", "CASTABLE", "FLOATS", "HALF_NAMES", "is_low", "short_name", "from_short_name", "half_key"]

LOW: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
CASTABLE: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
FLOATS = CASTABLE  # the dtypes a session's properties may name
HALF_NAMES: tuple[str, ...] = ("bfloat16", "float16")  # the half dtypes by name, as reports and the command write them


def is_low(dtype: torch.dtype) -> bool:
    """float16 or bfloat16."""
    return dtype in LOW


@overload
def short_name(dtype: torch.dtype) -> str: ...
@overload
def short_name(dtype: None) -> None: ...
@overload
def short_name(dtype: torch.dtype | None) -> str | None: ...
def short_name(dtype: torch.dtype | None) -> str | None:
    """"bfloat16" for torch.bfloat16 (the form reports and tables use); None passes."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def from_short_name(name: str | None) -> torch.dtype | None:
    """The inverse of `short_name` for `FLOATS` ("bfloat16" -> torch.bfloat16); None for
    anything else (a report written without a half dtype)."""
    return next((d for d in FLOATS if short_name(d) == name), None)


def half_key(dtype: torch.dtype | str | None) -> str | None:
    """The name of a half dtype ("bfloat16" for torch.bfloat16 or "bfloat16"), None for anything
    else (FP32, None): the key of per-dtype tables (`DeviceInfo.native`)."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return name if name in HALF_NAMES else None
