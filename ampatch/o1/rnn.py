"""RNN modules under O1.

`nn.RNN/LSTM/GRU.forward` compare the input dtype with the weight dtype in Python before
any patched function runs, so they are handled at the module level: the input (plain or
packed) and hidden state go to half, and the recurrence runs on half casts of the flat
weights (cached, so cast once per iteration). Gradients still reach the FP32 parameters.
RNN *cells* are plain functions and are patched through `torch._VF` by the policy.

The module itself is never modified: the original `forward` runs on a shallow view of the
module whose `_flat_weights` list holds the half casts. So one module can be called from
several threads at once, and nothing half is left behind in the module if a call fails.

Under `torch.compile` (with `torch._dynamo.config.allow_rnn`; by default Dynamo runs RNN
modules eagerly, where the view above applies), Dynamo traces the plain-Python twin,
which swaps `_flat_weights` for casts made in the graph and puts the list back.
"""
from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch

from ..base.patcher import Patcher, cast_switch
from ..base.tree import map_tensors
from .plans import HALF, OpPlan, plan
from .proxies import ModuleTwinProxy
from .twins import traced

RNN_CLASSES = (torch.nn.RNN, torch.nn.LSTM, torch.nn.GRU)


def _half_view(module: torch.nn.RNNBase, flat_weights: list) -> torch.nn.RNNBase:
    """A shallow copy of `module` (same parameters, buffers, settings) with its own
    `_flat_weights`: the original forward runs on it and the module stays untouched."""
    module._update_flat_weights()  # refresh after a functional_call etc., as forward would
    view = object.__new__(type(module))
    state = dict(vars(module))
    state["_flat_weights"] = flat_weights
    object.__setattr__(view, "__dict__", state)
    return view


@traced
def _traceable_forward(original: Callable, p: OpPlan) -> Callable:
    """The forward Dynamo traces: casts as graph nodes, `_flat_weights` swapped and restored."""
    target = p.target
    leaf = p.leaf(lambda t: t.to(target))

    def forward(module: torch.nn.RNNBase, *args: Any, **kwargs: Any) -> Any:
        flat = module._flat_weights
        module._flat_weights = [None if w is None else leaf(w) for w in flat]
        try:
            return original(module, *map_tensors(args, leaf), **map_tensors(kwargs, leaf))
        finally:
            module._flat_weights = flat

    forward.__name__ = forward.__qualname__ = f"ampatch_rnn_forward_{original.__qualname__}"
    return forward


def patch_rnn_modules(patcher: Patcher, cast_for: Callable[[torch.dtype], Callable[[torch.Tensor], torch.Tensor]],
                      dtype: torch.dtype) -> None:
    """Replace the forward of every RNN class so the whole recurrence runs in `dtype`
    (a HALF plan); `cast_for(dtype)` casts through the session's cast cache."""
    p = plan(HALF, "rnn", dtype)
    leaf = p.leaf(cast_for(dtype))  # a HALF plan's target

    def forward_in_half(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        module, args = args[0], args[1:]
        if not cast_switch.enabled:
            return wrapped(module, *args, **kwargs)
        half = [None if w is None else leaf(w) for w in module._flat_weights]
        return wrapped(_half_view(module, half), *map_tensors(args, leaf), **map_tensors(kwargs, leaf))

    for cls in RNN_CLASSES:
        original = vars(cls)["forward"]
        twin = ModuleTwinProxy(original, forward_in_half, _traceable_forward(original, p))
        patcher.patch(cls, "forward", _class_forward(original, twin))


@traced
def _class_forward(original: Callable, twin: Any) -> Callable:
    """The `forward` set on an RNN class: a plain function (Dynamo traces it like any
    forward) calling the wrapt twin, which Dynamo traces through `_torchdynamo_inline`.

    It carries the original's name, module, globals and `__wrapped__`, so `torch.jit.script`
    compiles the original forward (its source, its overloads, the names it uses), which
    runs without O1 casts like all scripted code."""
    def forward(self: torch.nn.Module, *args: Any, _twin: Any = twin, **kwargs: Any) -> Any:
        return _twin(self, *args, **kwargs)

    fn = types.FunctionType(forward.__code__, original.__globals__, original.__name__)
    fn.__kwdefaults__ = forward.__kwdefaults__
    return functools.update_wrapper(fn, original)
