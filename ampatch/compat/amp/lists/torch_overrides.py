"""`apex.amp.lists.torch_overrides`: ampatch's O1 lists for `torch` (see `lists`); `CASTS` are
the ops that promote mixed float arguments to the widest, `SEQUENCE_CASTS` those whose first
argument is a list of tensors."""
from __future__ import annotations

import torch

from ....o1.lists import torch_ops as core_lists

__all__ = ["MODULE", "FP16_FUNCS", "BFLOAT16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"]

MODULE = torch
FP16_FUNCS = list(core_lists.HALF)
BFLOAT16_FUNCS = list(core_lists.HALF)
FP32_FUNCS = list(core_lists.FLOAT)
CASTS = list(core_lists.PROMOTE)
SEQUENCE_CASTS = list(core_lists.SEQUENCE_PROMOTE)
