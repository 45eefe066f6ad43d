"""Model casting for O2/O3/O5: convert the model to half (batch norms optionally kept in
FP32), wrap `forward` so inputs arrive in half and outputs leave in FP32, and make
`state_dict()` return FP32 tensors.

Everything done to a model is recorded in a `ModelHandle`, so `restore()` can put the
model back to its original dtypes (from the FP32 masters where they exist).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

logger = logging.getLogger("ampatch")

_LOW = (torch.float16, torch.bfloat16)


def _is_batchnorm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def modules_to_cast(model: nn.Module, keep_batchnorm_fp32: bool | None) -> list[nn.Module]:
    """The modules whose own parameters and buffers go to half."""
    return [m for m in model.modules() if not (keep_batchnorm_fp32 and _is_batchnorm(m))]


def params_to_cast(model: nn.Module, keep_batchnorm_fp32: bool | None) -> list[nn.Parameter]:
    """Floating parameters that `cast_model` will convert (decided before converting)."""
    seen: set[int] = set()
    out = []
    for m in modules_to_cast(model, keep_batchnorm_fp32):
        for p in m.parameters(recurse=False):
            if p.is_floating_point() and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    bn_params = {id(p) for m in model.modules() if keep_batchnorm_fp32 and _is_batchnorm(m)
                 for p in m.parameters(recurse=False)}
    return [p for p in out if id(p) not in bn_params]


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
        return type(x)((k, cast_tree(v, dtype, only_low)) for k, v in x.items())
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
        self._on_load: list[Callable[[], None]] = []
        for m in modules_to_cast(model, keep_batchnorm_fp32):
            for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
                if t.is_floating_point():
                    self.original_dtypes.setdefault(id(t), (t, t.dtype))
            m._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
        self._wrap_forward(patcher, output_dtype)
        self._hooks.append(model._register_state_dict_hook(_fp32_state_dict))
        self._hooks.append(model.register_load_state_dict_post_hook(self._after_load))

    def _wrap_forward(self, patcher, output_dtype: torch.dtype | None) -> None:
        model, dtype = self.model, self.dtype
        inner = model.forward  # bound method (or an instance attribute someone set)

        only_low = output_dtype is None
        output_dtype = output_dtype or torch.float32

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = inner(*cast_tree(args, dtype), **cast_tree(kwargs, dtype))
            return cast_tree(out, output_dtype, only_low)

        forward.__wrapped__ = inner  # type: ignore[attr-defined]
        patcher.patch(model, "forward", forward)

    def on_load(self, callback: Callable[[], None]) -> None:
        """Run `callback` after every `model.load_state_dict` (masters re-sync from it)."""
        self._on_load.append(callback)

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        for cb in self._on_load:
            cb()

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


def _fp32_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor) and v.dtype in _LOW:
            state_dict[k] = v.detach().float()
    return state_dict


def iter_params(models: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Parameters of several models, each once."""
    seen: set[int] = set()
    out = []
    for m in models:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out
