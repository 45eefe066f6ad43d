"""What `initialize` checks about the models it is given, before anything changes.

`check_incoming_dtypes` is Apex's refusal of float16 models: `initialize` takes the FP32
model and does the casting itself. `_amp_state.allow_incoming_model_not_fp32 = True` lets
float16 params and buffers in (they then get FP32 master weights where master weights are on).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from ..config.properties import warn_or_err

__all__ = ["check_incoming_dtypes"]


def check_incoming_dtypes(models: Iterable[torch.nn.Module], allow_not_fp32: bool = False,
                          hard_override: bool = False) -> None:
    """Raise (Apex's `warn_or_err`) at the first float16 parameter or buffer, unless allowed."""
    if allow_not_fp32:
        return
    for model in models:
        tensors = [("param", n, t) for n, t in model.named_parameters()]
        tensors += [("buffer", n, t) for n, t in model.named_buffers()]
        for kind, name, t in tensors:
            if t.dtype == torch.float16:
                warn_or_err(f"Found {kind} {name} of dtype {t.dtype}; amp.initialize expects an FP32 model and "
                            "does any casting itself: do not call .half() on the model before passing it. To "
                            "pass float16 parameters on purpose, set amp._amp_state.allow_incoming_model_not_fp32 "
                            "= True before amp.initialize.", hard_override)
                return
