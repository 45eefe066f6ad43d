"""RNN modules under O1.

`nn.RNN/LSTM/GRU.forward` compare the input dtype with the weight dtype in Python before
any patched function runs, so they are handled at the module level: the input (plain or
packed) and hidden state go to half, and the flat weights are swapped for their cached
half casts for the duration of the call. Gradients still reach the FP32 parameters.
RNN *cells* are plain functions and are patched through `torch._VF` by the policy.
"""
from __future__ import annotations

from typing import Any

import torch
import wrapt
from torch.nn.utils.rnn import PackedSequence

from .patching import Caster, Patcher, _switch

RNN_CLASSES = (torch.nn.RNN, torch.nn.LSTM, torch.nn.GRU)


def _to_half(x: Any, caster: Caster, dtype: torch.dtype) -> Any:
    if isinstance(x, PackedSequence):
        return x._replace(data=caster.to_half(x.data, dtype))
    if isinstance(x, tuple):
        return tuple(_to_half(y, caster, dtype) for y in x)
    return caster.to_half(x, dtype)


def patch_rnn_modules(patcher: Patcher, caster: Caster, dtype: torch.dtype) -> None:
    """Wrap the forward of every RNN class so the whole recurrence runs in `dtype`."""
    switch = _switch

    def forward_in_half(wrapped, instance, args, kwargs):
        if not switch.enabled or instance is None:
            return wrapped(*args, **kwargs)
        flat = instance._flat_weights
        instance._flat_weights = [None if w is None else caster.to_half(w, dtype) for w in flat]
        try:
            return wrapped(*[_to_half(a, caster, dtype) for a in args],
                           **{k: _to_half(v, caster, dtype) for k, v in kwargs.items()})
        finally:
            instance._flat_weights = flat

    for cls in RNN_CLASSES:
        patcher.patch(cls, "forward", wrapt.FunctionWrapper(vars(cls)["forward"], forward_in_half))
