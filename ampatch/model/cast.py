"""Model casting for O2/O3/O5: convert the model to half (batch norms, and the modules
`keep_fp32` names, optionally kept in FP32), wrap `forward` (see forwards.py) so inputs arrive
in half and outputs leave in FP32, and make `state_dict()` return FP32 tensors (a param's
FP32 master where it has one: the exact weights, whichever order a checkpoint loads in).

Everything done to a model is recorded in a `ModelHandle`, so `restore()` can put the
model back to its original dtypes (from the FP32 masters where they exist).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch import nn

from . import hf_conventions
from ..base.dtypes import LOW
from .forwards import CastForward, install_forward

logger = logging.getLogger("ampatch")


def is_batchnorm(module: nn.Module) -> bool:
    """A batch norm (SyncBatchNorm included): what keep_batchnorm_fp32 keeps in FP32."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def modules_to_cast(model: nn.Module, keep_batchnorm_fp32: bool | None,
                    kept: Collection[int] = frozenset()) -> list[nn.Module]:
    """The modules whose own parameters and buffers go to half: all but batch norms (with
    `keep_batchnorm_fp32`) and the modules `keep_fp32` keeps (`kept`: their ids and those of
    every module inside them, `keep.kept_module_ids`)."""
    return [m for m in model.modules() if not (keep_batchnorm_fp32 and is_batchnorm(m)) and id(m) not in kept]


def params_to_cast(model: nn.Module, keep_batchnorm_fp32: bool | None,
                   kept: Collection[int] = frozenset()) -> list[nn.Parameter]:
    """Floating parameters that `ModelHandle` will convert (known before converting, so
    masters can be made from the FP32 values)."""
    out = {id(p): p for m in modules_to_cast(model, keep_batchnorm_fp32, kept)
           for p in m.parameters(recurse=False) if p.is_floating_point()}
    return list(out.values())


class Cast:
    """One parameter or buffer the cast converted: its dtype before, and its exact values
    before (`shadow`; None where an FP32 master holds them, or for the second name of a tied
    parameter), so `deinitialize` gives back the very values, not half-rounded ones."""

    __slots__ = ("is_param", "dtype", "shadow")

    def __init__(self, is_param: bool, dtype: torch.dtype, shadow: torch.Tensor | None) -> None:
        self.is_param, self.dtype, self.shadow = is_param, dtype, shadow


def _keep(t: torch.Tensor, copy: bool = False) -> torch.Tensor:
    """`t`'s values, kept past the cast (a reference, or a copy with `copy=True`); CUDA
    tensors are kept on the CPU, so the half model's device memory is what O2/O3 promise."""
    t = t.detach()
    return t.to("cpu", copy=copy) if t.device.type == "cuda" else (t.clone() if copy else t)


class ModelHandle:
    """One model under O2/O3/O5: how it was cast and how to undo it.

    What was converted is recorded per (module, name), not per tensor object: the cast
    replaces buffer objects (`Module._apply`), and torch may replace them again later.
    With master weights, `mastered` holds the ids of params whose FP32 master keeps their
    values, and the others (frozen params) keep theirs here; without (None: O3), params are
    trained in half and only buffers keep their values (an FP32 copy of the whole model
    would defeat O3). `seen` (shared by the session's model handles) maps the id of every
    param cast so far to its original dtype, so a param shared by two models, or tied
    within one, is restored once and still saved in full precision under every name.
    `kept` (ids, see `modules_to_cast`) stay FP32; a model kept whole keeps the forward
    wrapper `keep_in_fp32` gave it."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, keep_batchnorm_fp32: bool | None,
                 output_dtype: torch.dtype | None, patcher, mastered: set[int] | None = None,
                 seen: dict[int, torch.dtype] | None = None, kept: Collection[int] = frozenset()) -> None:
        self.model = model
        self.dtype = dtype
        self.casts: list[tuple[nn.Module, dict[str, Cast]]] = []  # a list: modules may be unhashable
        self._hooks: list[Any] = []
        self._on_load: list[Callable[[dict[int, torch.Tensor], list[torch.Tensor]], None]] = []
        self._values: list[Callable[[torch.Tensor], torch.Tensor | None]] = []
        seen = {} if seen is None else seen
        # what `model.dtype` says before the cast (transformers' convention: the first floating param)
        self.original_dtype = next((seen.get(id(p), p.dtype) for p in model.parameters() if p.is_floating_point()),
                                   None)
        for m in modules_to_cast(model, keep_batchnorm_fp32, kept):
            own: dict[str, Cast] = {}
            for name, p in m._parameters.items():
                if p is None or not p.is_floating_point():
                    continue
                if id(p) in seen:  # tied, or shared with a model cast before: restored there
                    own[name] = Cast(True, seen[id(p)], None)
                elif p.dtype != dtype:
                    seen[id(p)] = p.dtype
                    keep = mastered is not None and id(p) not in mastered
                    own[name] = Cast(True, p.dtype, _keep(p) if keep else None)
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point() and b.dtype != dtype:
                    own[name] = Cast(False, b.dtype, _keep(b))
            m._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)
            if own:
                self.casts.append((m, own))
        if id(model) not in kept:
            self._wrap_forward(patcher, output_dtype)
        for m, own in self.casts:
            load_hook = LoadHook(self._on_load, own)
            self._hooks.append(m._register_state_dict_hook(_FullPrecisionStateDict(own, self._values)))
            self._hooks.append(m._register_load_state_dict_pre_hook(load_hook.pre, with_module=True))
            self._hooks.append(m.register_load_state_dict_post_hook(load_hook))

    def _wrap_forward(self, patcher, output_dtype: torch.dtype | None) -> None:
        model = self.model
        inner = model.forward  # bound method (or an instance attribute someone set)
        install_forward(model, CastForward(inner, self.dtype, output_dtype), patcher)
        # Hugging Face entry points that reach submodules without passing forward (generate,
        # get_image_features, ...): inputs cast the same way; their calls of forward cast as usual
        for name in hf_conventions.entry_points(model):
            patcher.patch(model, name, CastForward(getattr(model, name), self.dtype, output_dtype, nests=False))
        if self.original_dtype is not None and hf_conventions.saves_config_dtype(model):
            patcher.patch(model, "save_pretrained", hf_conventions.SavePretrained(model.save_pretrained,
                                                                               self.original_dtype))

    def on_load(self, callback: Callable[[dict[int, torch.Tensor], list[torch.Tensor]], None]) -> None:
        """Run `callback(incoming, params)` after a `load_state_dict` of the model or any of its
        submodules, once per module with cast params: `params` are that module's own params,
        `incoming` maps id(param) to the tensor torch loaded into it (masters re-sync from it,
        not from the rounded model)."""
        self._on_load.append(callback)

    def saves_from(self, value_of: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """`state_dict()` saves a cast param as `value_of(param)` where that gives a tensor (its
        FP32 master's value, which training continues from), else its half value widened."""
        self._values.append(value_of)

    def restore(self, masters: dict[int, torch.Tensor]) -> None:
        """Back to the original dtypes: from the FP32 masters (by id of model param) where they
        exist, else from the values kept at the cast if the tensor still holds them rounded,
        else the current values converted; each onto the device the tensor is on now (a model
        moved after the cast, e.g. to the CPU before Lightning's teardown, stays there)."""
        for h in self._hooks:
            h.remove()
        with torch.no_grad():
            for m, own in self.casts:
                for name, c in own.items():
                    store = m._parameters if c.is_param else m._buffers
                    t = store.get(name)
                    if t is None or t.dtype != self.dtype:  # replaced by the user, or restored already
                        continue
                    master = masters.get(id(t)) if c.is_param else None
                    if master is not None:  # onto the param's device now (moved since: Lightning's teardown)
                        value = master.detach().to(t.device, c.dtype)
                    elif c.shadow is not None and _rounds_to(c.shadow, t):
                        value = c.shadow.to(t.device)
                    else:
                        value = t.detach().to(c.dtype)
                    if c.is_param:
                        t.data = value
                        t.grad = None
                    else:
                        store[name] = value


def _rounds_to(exact: torch.Tensor, half: torch.Tensor) -> bool:
    """`half` still holds `exact` rounded (nothing changed it since the cast)."""
    return exact.shape == half.shape and torch.equal(exact.to(half.device, half.dtype), half)


class LoadHook:
    """`load_state_dict` hooks of one cast module: the pre-hook notes the incoming tensor of
    each of its params and buffers (the FP32 values of a checkpoint, before they are rounded
    into the half model); the post-hook keeps the exact values of what torch loaded, and
    hands the params' to the session's callbacks, so masters re-sync from them. A tensor
    torch refused (wrong shape: torch reports it after the hooks ran) changes nothing.

    `load_state_dict(assign=True)` would replace the half params (which the optimizer's
    masters point at) with the checkpoint's tensors: it is refused with the fix.

    A copy of the model (deepcopy, pickle) has no masters and must not reach into the
    session: it gets an inert hook.
    """

    def __init__(self, callbacks: list, casts: dict[str, Cast]) -> None:
        self.callbacks = callbacks
        self.casts = casts
        self.incoming: dict[str, torch.Tensor] = {}

    def pre(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *args: Any) -> None:
        self.incoming = {}
        if not self.casts:
            return
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError("load_state_dict(..., assign=True) would replace the parameters amp.initialize "
                               "cast to half (and that the optimizer's FP32 masters follow); load with "
                               "assign=False, or load before amp.initialize.")
        for name in self.casts:
            t = state_dict.get(prefix + name)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.incoming[name] = t

    def __call__(self, module: nn.Module, incompatible: Any) -> None:
        incoming, self.incoming = self.incoming, {}
        if not self.casts:
            return
        by_param: dict[int, torch.Tensor] = {}
        params = []
        for name, c in self.casts.items():
            t = (module._parameters if c.is_param else module._buffers).get(name)
            if t is None:
                continue
            src = incoming.get(name)
            if src is not None and src.shape != t.shape:
                src = None  # torch refused it: "size mismatch"
            if c.is_param:
                params.append(t)
                if src is not None:
                    by_param[id(t)] = src
            if src is not None and c.shadow is not None:
                c.shadow = _keep(src.to(c.dtype), copy=True)
        for cb in self.callbacks:
            cb(by_param, params)

    def __reduce__(self) -> tuple:
        return (LoadHook, ([], {}))


class _FullPrecisionStateDict:
    """State-dict hook of one cast module: its converted tensors are saved in their original
    dtype; a param whose master a `values` callback gives (`ModelHandle.saves_from`) is saved
    as that master's value. `state_dict(keep_vars=True)` asks for the live parameters and
    buffers themselves: those are left as they are. A copy of the model (deepcopy, pickle)
    has no masters: its hook only widens."""

    def __init__(self, casts: dict[str, Cast], values: list | None = None) -> None:
        self.dtypes = {name: c.dtype for name, c in casts.items()}
        self.params = {name for name, c in casts.items() if c.is_param}
        self.values = [] if values is None else values

    def __call__(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
        for name, dtype in self.dtypes.items():
            key = prefix + name
            v = state_dict.get(key)
            if (isinstance(v, torch.Tensor) and v.dtype in LOW and v.dtype != dtype
                    and v is not module._parameters.get(name) and v is not module._buffers.get(name)):
                exact = self._master_value(module._parameters.get(name)) if name in self.params else None
                state_dict[key] = (exact if exact is not None else v.detach()).to(dtype)
        return state_dict

    def _master_value(self, p: torch.Tensor | None) -> torch.Tensor | None:
        if p is None:
            return None
        for value_of in self.values:
            exact = value_of(p)
            if exact is not None:
                return exact
        return None

    def __reduce__(self) -> tuple:
        return (_inert_state_dict_hook, (self.dtypes, self.params))


def _inert_state_dict_hook(dtypes: dict[str, torch.dtype], params: set[str]) -> _FullPrecisionStateDict:
    """The hook of a copied model: it widens, and knows no masters."""
    hook = _FullPrecisionStateDict({})
    hook.dtypes, hook.params = dict(dtypes), set(params)
    return hook
