"""`apex.amp.lists.torch_overrides`: ampatch's O1 lists for `torch` (see `lists`); `CASTS` are
the ops that promote mixed float arguments to the widest, `SEQUENCE_CASTS` those whose first
argument is a list of tensors."""
from __future__ import annotations

import torch

from ....o1.lists import torch_ops as policy

__all__ = ["MODULE", "FP16_FUNCS", "BFLOAT16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"]

MODULE = torch
FP16_FUNCS = list(policy.HALF)
BFLOAT16_FUNCS = list(policy.HALF)
FP32_FUNCS = list(policy.FLOAT)
CASTS = list(policy.PROMOTE)
SEQUENCE_CASTS = list(policy.SEQUENCE_PROMOTE)
