"""`apex.amp.lists.functional_overrides`: ampatch's O1 lists for `torch.nn.functional` (see `lists`)."""
from __future__ import annotations

import torch

from ....o1.lists import functional as core_lists

__all__ = ["MODULE", "FP16_FUNCS", "BFLOAT16_FUNCS", "FP32_FUNCS", "BANNED_FUNCS"]

MODULE = torch.nn.functional
FP16_FUNCS = list(core_lists.HALF)
BFLOAT16_FUNCS = list(core_lists.HALF)
FP32_FUNCS = list(core_lists.FLOAT)
BANNED_FUNCS = list(core_lists.BANNED.items())  # (name, message), as Apex's
