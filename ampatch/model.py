"""Model casting for O2/O3/O5: convert the model to half (batch norms optionally kept in
FP32), wrap `forward` so inputs arrive in half and outputs leave in FP32, and make
`state_dict()` return FP32 tensors.

Everything done to a model is recorded in a `ModelHandle`, so `restore()` can put the
model back to its original dtypes (from the FP32 masters where they exist).
"""
from __future__ import annotations

import collections
import copy
import itertools
import logging
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from .tips import hint_dtype_error

logger = logging.getLogger("ampatch")

_LOW = (torch.float16, torch.bfloat16)


def _is_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def modules_to_cast(model: nn.Module, keep_batchnorm_fp32: bool | None) -> list[nn.Module]:
    """The modules whose own parameters and buffers go to half."""
    return [m for m in model.modules() if not (keep_batchnorm_fp32 and _is_batchnorm(m))]


def params_to_cast(model: nn.Module, keep_batchnorm_fp32: bool | None) -> list[nn.Parameter]:
    """Floating parameters that `ModelHandle` will convert (known before converting, so
    masters can be made from the FP32 values)."""
    out = {id(p): p for m in modules_to_cast(model, keep_batchnorm_fp32)
           for p in m.parameters(recurse=False) if p.is_floating_point()}
    return list(out.values())


def cast_tree(x: Any, dtype: torch.dtype, only_low: bool = False) -> Any:
    """Cast floating tensors nested in lists, tuples, namedtuples and dicts to `dtype`, and
    custom batch objects through their `.to(dtype)`; numpy arrays, integer tensors and the
    rest pass untouched. `only_low` casts just float16/bfloat16 tensors (model outputs)."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point() and x.dtype != dtype and (not only_low or x.dtype in _LOW):
            return x.to(dtype)
        return x
    if isinstance(x, (str, bytes, np.ndarray)) or x is None:
        return x
    if isinstance(x, dict):
        items = [(k, cast_tree(v, dtype, only_low)) for k, v in x.items()]
        if isinstance(x, collections.defaultdict):  # its first constructor argument is the factory
            return type(x)(x.default_factory, items)
        return type(x)(items)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(cast_tree(v, dtype, only_low) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(cast_tree(v, dtype, only_low) for v in x)
    if callable(getattr(x, "to", None)) and not isinstance(x, nn.Module) and not only_low:
        return x.to(dtype)
    return x


class ModelHandle:
    """One model under O2/O3/O5: how it was cast and how to undo it."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool | None,
                 output_dtype: torch.dtype | None, patcher) -> None:
        self.model = model
        self.dtype = dtype
        self.original_dtypes: dict[int, tuple[torch.Tensor, torch.dtype]] = {}
        self._hooks: list[Any] = []
        self._on_load: list[Callable[[dict[int, torch.Tensor]], None]] = []
        for m in modules_to_cast(model, keep_batchnorm_fp32):
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                if t.is_floating_point():
                    self.original_dtypes.setdefault(id(t), (t, t.dtype))
            m._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
        self._on_load_hook = _LoadHook(self._on_load)
        self._wrap_forward(patcher, output_dtype)
        self._hooks.append(model._register_state_dict_hook(_fp32_state_dict))
        self._hooks.append(model._register_load_state_dict_pre_hook(self._on_load_hook.pre, with_module=True))
        self._hooks.append(model.register_load_state_dict_post_hook(self._on_load_hook))

    def _wrap_forward(self, patcher, output_dtype: torch.dtype | None) -> None:
        model = self.model
        inner = model.forward  # bound method (or an instance attribute someone set)
        patcher.patch(model, "forward", _CastForward(inner, self.dtype, output_dtype))
        # nn.DataParallel copies the instance __dict__ into each replica: give each replica a
        # forward bound to itself, or every replica would run the original's weights (Apex's
        # O2 + DataParallel device-mismatch bug).
        patcher.patch(model, "_replicate_for_data_parallel", _Replicate(model._replicate_for_data_parallel))

    def on_load(self, callback: Callable[[dict[int, torch.Tensor]], None]) -> None:
        """Run `callback(incoming)` after every `model.load_state_dict`; `incoming` maps
        id(param) to the loaded tensor (masters re-sync from it, not from the rounded model)."""
        self._on_load.append(callback)

    def restore(self, masters: dict[int, torch.Tensor]) -> None:
        """Back to the original dtypes; FP32 masters (by id of model param) give exact values."""
        for h in self._hooks:
            h.remove()
        with torch.no_grad():
            for t, dtype in self.original_dtypes.values():
                master = masters.get(id(t))
                t.data = master.detach().to(dtype) if master is not None else t.data.to(dtype)
                if t.grad is not None:
                    t.grad = None


def wrap_outputs(model: nn.Module, output_dtype: torch.dtype, patcher) -> None:
    """`cast_model_outputs` at a level that leaves the model alone (O0/O1/O4), as in Apex:
    floating outputs are cast to `output_dtype`, inputs pass untouched."""
    patcher.patch(model, "forward", _CastForward(model.forward, None, output_dtype))
    patcher.patch(model, "_replicate_for_data_parallel", _Replicate(model._replicate_for_data_parallel))


class _CastForward:
    """`model.forward` under O2/O3/O5: floating inputs to half, half outputs to FP32 (or
    `cast_model_outputs`); with `dtype=None` (see `wrap_outputs`) only the outputs are cast.

    A plain object rather than a closure so the model stays copyable and picklable:
    `copy.deepcopy(model)` (EMA copies) rebinds `__wrapped__`, a bound method, to the copy,
    so the copy runs its own weights; pickling stores it as `getattr(model, "forward")`,
    which resolves to the class's forward while the model is being rebuilt.
    """

    def __init__(self, inner: Callable[..., Any], dtype: torch.dtype | None,
                 output_dtype: torch.dtype | None) -> None:
        self.__wrapped__ = inner
        self.dtype = dtype  # None: inputs pass as they are (outputs-only wrapper)
        self.only_low = output_dtype is None
        self.output_dtype = output_dtype or torch.float32

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.dtype is not None:
            args, kwargs = cast_tree(args, self.dtype), cast_tree(kwargs, self.dtype)
        try:
            out = self.__wrapped__(*args, **kwargs)
        except (RuntimeError, TypeError, ValueError) as exc:  # e.g. an FP32 constant meets half
            hint_dtype_error(exc, model_dtype=self.dtype)
            raise
        return cast_tree(out, self.output_dtype, self.only_low)

    def bound_to(self, replica: nn.Module) -> "_CastForward":
        """The same wrapper around `replica`'s own forward."""
        inner = self.__wrapped__
        if isinstance(inner, types.MethodType):
            inner = types.MethodType(inner.__func__, replica)
        clone = copy.copy(self)
        clone.__wrapped__ = inner
        return clone


class _Replicate:
    """`model._replicate_for_data_parallel` of a cast model: the replica's forward wrapper is
    rebound to the replica."""

    def __init__(self, inner: Callable[[], nn.Module]) -> None:
        self.inner = inner

    def __call__(self) -> nn.Module:
        replica = self.inner()
        forward = replica.__dict__.get("forward")
        if isinstance(forward, _CastForward):
            replica.__dict__["forward"] = forward.bound_to(replica)
        replica.__dict__.pop("_replicate_for_data_parallel", None)
        return replica


class _LoadHook:
    """`load_state_dict` hooks: the pre-hook notes the incoming tensor of each parameter (the
    FP32 values of a checkpoint, before they are rounded into the half model), the post-hook
    hands them to the session's callbacks, so masters re-sync from the exact values.

    A copy of the model (deepcopy, pickle) has no masters and must not reach into the
    session: it gets an inert hook.
    """

    def __init__(self, callbacks: list[Callable[[dict[int, torch.Tensor]], None]]) -> None:
        self.callbacks = callbacks
        self.incoming: dict[int, torch.Tensor] = {}

    def pre(self, module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
        if self.callbacks:
            for name, p in module.named_parameters():
                t = state_dict.get(prefix + name)
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    self.incoming[id(p)] = t

    def __call__(self, module: nn.Module, incompatible: Any) -> None:
        incoming, self.incoming = self.incoming, {}
        for cb in self.callbacks:
            cb(incoming)

    def __reduce__(self) -> tuple:
        return (_LoadHook, ([],))


def _fp32_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    """This model's half tensors in the state dict to FP32 copies. `state_dict(keep_vars=True)`
    asks for the live parameters and buffers themselves: those are left as they are."""
    live = {id(t) for t in itertools.chain(module.parameters(), module.buffers())}
    for k, v in state_dict.items():
        if (k.startswith(prefix) and isinstance(v, torch.Tensor) and v.dtype in _LOW
                and id(v) not in live):
            state_dict[k] = v.detach().float()
    return state_dict
