"""`optimizer._amp_stash` and Apex's lazy-init methods, as views over the optimizer's handle.

Apex's `amp.initialize` hung an `_amp_stash` object on each optimizer, and scripts read it:
NVIDIA's BERT pretraining steps `all_fp32_from_fp16_params` after its own all-reduce, clears
their grads on overflow, and on resume calls `optimizer._lazy_init_maybe_master_weights()`
and sets `_amp_stash.lazy_init_called = True`. Here the stash is a view of the handle's
masters (recomputed on each read, no copy), and the lazy init is a no-op: ampatch makes the
masters at `initialize`. `ampatch.frameworks.apex` lends `ATTRIBUTES` to the core by name
(the core never imports compat, which sits above it), so every optimizer a session patches
has them, whatever was imported before, and loses them when the session ends.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from ...base.dtypes import LOW
from ...errors import ReadOnlyError
from ...optim.context import GradStage
from ...optim.handle import OptimizerHandle
from .scaler import device_of

logger = logging.getLogger("ampatch")

__all__ = ["AmpStash", "AmpOptimizerState", "attributes", "ATTRIBUTES"]


class AmpStash:
    """Apex's `AmpOptimizerState` for one optimizer, over its handle.

    With master weights (O2/O5): `fp16_groups`, `fp32_from_fp16_groups`, `fp32_from_fp32_groups`
    (per param group) and their `all_*` concatenations: the half model params, their FP32
    masters (what the optimizer steps) and the FP32 params that are their own masters.
    Without (O0/O1/O3/O4): `all_fp16_params` and `all_fp32_params`. These lists are views
    and refuse writes; anything else a script sets (`lazy_init_called`, ...) is kept, as on
    Apex's plain object."""

    _VIEWS = ("fp16_groups", "fp32_from_fp16_groups", "fp32_from_fp32_groups", "all_fp16_params",
              "all_fp32_from_fp16_params", "all_fp32_from_fp32_params", "all_fp32_params",
              "params_have_scaled_gradients", "dummy_overflow_buf")
    _handle: OptimizerHandle        # set by object.__setattr__: __setattr__ below guards the views
    _buf: torch.Tensor | None

    def __init__(self, handle: OptimizerHandle) -> None:
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_buf", None)
        self.lazy_init_called = True  # ampatch's masters exist from initialize on
        self.already_patched = False
        from ..extensions import amp_C  # the kernels, only when a stash is made
        self.multi_tensor_scale = amp_C.multi_tensor_scale
        self.multi_tensor_l2norm = amp_C.multi_tensor_l2norm

    def _groups(self) -> list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]]:
        """Per param group: (half model params with a master, their masters, the other params)."""
        h = self._handle
        out = []
        for group in h.optimizer.param_groups:
            pairs, own = h.masters.split(group["params"])
            out.append(([mp for mp, _ in pairs], [m for _, m in pairs], own))
        return out

    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        return [half for half, _, _ in self._groups()]

    @property
    def fp32_from_fp16_groups(self) -> list[list[torch.Tensor]]:
        return [masters for _, masters, _ in self._groups()]

    @property
    def fp32_from_fp32_groups(self) -> list[list[torch.Tensor]]:
        return [own for _, _, own in self._groups()]

    @property
    def all_fp16_params(self) -> list[torch.Tensor]:
        """Half model params: those with an FP32 master, or (no masters) every half param stepped."""
        if self._handle.use_masters:
            return [p for half, _, _ in self._groups() for p in half]
        return [p for p in self._handle.params() if p.dtype in LOW]

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        return [m for _, masters, _ in self._groups() for m in masters]

    @property
    def all_fp32_from_fp32_params(self) -> list[torch.Tensor]:
        return [p for _, _, own in self._groups() for p in own]

    @property
    def all_fp32_params(self) -> list[torch.Tensor]:
        """Without master weights: the FP32 params the optimizer steps."""
        return [p for p in self._handle.params() if p.dtype not in LOW]

    @property
    def params_have_scaled_gradients(self) -> bool:
        """A `delay_unscale` backward left scaled gradients."""
        return self._handle.stage is GradStage.SCALED

    @property
    def dummy_overflow_buf(self) -> torch.Tensor:
        """Apex's int flag buffer for the multi-tensor kernels, on the params' device."""
        buf = self._buf
        if buf is None:
            buf = torch.zeros(1, dtype=torch.int, device=device_of([self._handle]))
            object.__setattr__(self, "_buf", buf)
        return buf

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._VIEWS:
            raise ReadOnlyError(f"optimizer._amp_stash.{name} is a view of the optimizer's params under ampatch and "
                                "cannot be replaced; change the optimizer's param_groups instead.")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"<ampatch _amp_stash of optimizers[{self._handle.index}]>"


def _lazy_init(handle: OptimizerHandle) -> Any:
    def _lazy_init_maybe_master_weights() -> None:
        """Apex made the masters at the first backward; ampatch made them at initialize: nothing to do."""
    return _lazy_init_maybe_master_weights


def _amp_lazy_init(handle: OptimizerHandle) -> Any:
    def _amp_lazy_init() -> None:
        """Nothing to do: the masters exist from initialize on."""
    return _amp_lazy_init


def _masters_to_model(handle: OptimizerHandle) -> Any:
    def _master_params_to_model_params() -> None:
        """Copy the FP32 masters into the half model params (after a script changed the masters)."""
        handle.masters.copy_to_model()
    return _master_params_to_model_params


AmpOptimizerState = AmpStash  # Apex's name for the class of `optimizer._amp_stash`

# The attributes an optimizer a session patches gets: name -> the value for its handle.
ATTRIBUTES = {"_amp_stash": AmpStash, "_lazy_init_maybe_master_weights": _lazy_init,
              "_amp_lazy_init": _amp_lazy_init, "_master_params_to_model_params": _masters_to_model}


def attributes(handle: OptimizerHandle) -> dict[str, Any]:
    """Apex's attributes for `handle`'s optimizer (what the core sets when it patches one)."""
    return {name: make(handle) for name, make in ATTRIBUTES.items()}
