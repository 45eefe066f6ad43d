"""What Apex's two FP16_Optimizers share (`apex.fp16_utils.FP16_Optimizer` in
`fp16_optimizer`, `apex.optimizers.FP16_Optimizer` in `optimizers.fp16_optimizer`), over ampatch's
own machinery and with no session: the wrapped optimizer's FP32 masters, the unscale into them
with the inf/NaN check, the skipped step and the copy back into the half model are an
`optim.handle.OptimizerHandle`; the scale rule is a `scaler.LossScaler` (settled by a
`scaler.Verdict`).

The handle patches the wrapped optimizer with the wrapper's own `Patcher`, independent of any
amp session; the patches (and the masters in its param_groups) go when the wrapper is garbage
collected.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._utils import _unflatten_dense_tensors

from ...base.dtypes import LOW
from ...base.patcher import Patcher
from ...config.values import check_scale_value
from ...errors import ConfigError, ConfigTypeError, InvalidCallError
from ...optim import calls
from ...optim.context import GradStage, HandleContext
from ...optim.handle import OptimizerHandle
from ...optim.masters import MASTERS_KEY
from ...optim.scaler import LossScaler, Verdict
from ...session.session import current as current_session
from ..amp.stash import AmpStash

logger = logging.getLogger("ampatch")

__all__ = ["MasterWeightOptimizer", "WrapperOwner"]

_FLOATS = (*LOW, torch.float32)

# optimizer -> its live wrapper (weakly): an optimizer is wrapped once
_WRAPPERS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref]" = weakref.WeakKeyDictionary()


def _check_unwrapped(optimizer: torch.optim.Optimizer, name: str) -> None:
    """An optimizer gets FP32 masters once: from one wrapper, or from amp.initialize."""
    ref = _WRAPPERS.get(optimizer)
    if ref is not None and ref() is not None:
        raise ConfigError(f"{name}: this optimizer is already wrapped by an FP16_Optimizer; wrap it once (a second "
                          "wrapper would give its params a second set of FP32 masters).")
    s = current_session()
    if s is not None and any(h.optimizer is optimizer for h in s.optimizers):
        raise ConfigError(f"{name}: this optimizer was passed to amp.initialize, which gives it FP32 masters and loss "
                          "scaling already; use amp.scale_loss, or amp.deinitialize() before wrapping it.")


def _release(handle: OptimizerHandle, patcher: Patcher) -> None:
    """The wrapper is gone: the optimizer's methods, params and state dtypes are its own again."""
    patcher.restore_all()
    handle.unswap()
    handle.recast_state()


class WrapperOwner:
    """The `ScalerOwner` of a wrapper's `loss_scaler` view: its one optimizer; a static scale
    can be set (Apex: `optimizer.loss_scale = new_scale`), a dynamic one is clamped."""

    def __init__(self, handle: OptimizerHandle, name: str) -> None:
        self._handle, self._name = handle, name

    def live(self) -> None:
        """A wrapper's scaler lives as long as the wrapper."""

    def handles(self) -> list[OptimizerHandle]:
        return [self._handle]

    def iteration(self) -> int:
        return self._handle.steps

    def describe(self) -> str:
        return f"{self._name}.loss_scaler"

    def set_scale(self, scaler: LossScaler, value: Any) -> None:
        value = check_scale_value(value, "loss_scale")
        scaler.scale = scaler.clamp(value) if scaler.dynamic else value


class MasterWeightOptimizer:
    """Apex's FP16_Optimizer skeleton: FP32 masters for the half params of `init_optimizer`
    (float16 or bfloat16, those that require grad), a loss scale, `backward(loss)` that scales
    it and leaves the grads scaled until `_unscale()`, a step skipped on overflow."""

    name = "FP16_Optimizer"

    def __init__(self, init_optimizer: torch.optim.Optimizer, scaler: LossScaler) -> None:
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise ConfigTypeError(f"{self.name} wraps a torch.optim.Optimizer, got {type(init_optimizer).__name__}.")
        for group in init_optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.dtype not in _FLOATS:
                    raise ConfigTypeError(f"{self.name}: parameters must be float16, bfloat16 or float32; got "
                                          f"{p.dtype} (shape {tuple(p.shape)}).")
        _check_unwrapped(init_optimizer, self.name)
        self.optimizer = init_optimizer
        self._scaler = scaler
        ids = {id(p) for g in init_optimizer.param_groups for p in g["params"] if p.requires_grad and p.dtype in LOW}
        self._handle = OptimizerHandle(init_optimizer, 0, ids, HandleContext(level=self.name, scaled_closures=True))
        patcher = Patcher()
        self._handle.install(patcher)
        _WRAPPERS[init_optimizer] = weakref.ref(self)
        self._stash = AmpStash(self._handle)
        weakref.finalize(self, _release, self._handle, patcher)

    # ------------------------------------------------------------------ gradients
    def _scaled_backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """`(loss.float() * scale).backward()`; the new grads stay scaled (the stage is SCALED)
        until `_unscale`, added to what was there."""
        if not isinstance(loss, torch.Tensor):
            raise ConfigTypeError(f"{self.name}.backward expects the loss tensor, got {type(loss).__name__}.")
        handle, scale = self._handle, self._scaler.scale
        handle.before_backward(scale)
        try:
            (loss.float() * scale).backward(retain_graph=retain_graph)
        except BaseException:
            handle.after_backward(scale, None, delay_unscale=False)  # what the backward wrote, unscaled
            raise
        handle.after_backward(scale, None, delay_unscale=True)

    def _unscale(self) -> bool | None:
        """Unscale the pending grads into the masters and settle the scale; returns whether
        they overflowed (None when nothing was pending)."""
        handle = self._handle
        if handle.stage is not GradStage.SCALED:
            return None
        found = handle.after_backward(self._scaler.scale, None, delay_unscale=False)
        Verdict(self._scaler, found, iteration=lambda: handle.steps)()
        return self._scaler.last_overflow

    def _zero_grad(self, set_to_none: bool) -> None:
        """The grads of the masters, the FP32 params and the half model to None or zero, through
        the wrapped optimizer's zero_grad as it declares itself (a fused one may take no argument)."""
        handle = self._handle
        calls.zero_grad(self.optimizer, set_to_none, [*handle.params(), *handle.model_params()])

    def _skip(self) -> None:
        """This step is skipped: params and optimizer state untouched, master grads dropped."""
        self._handle.skip_next_step()
        self._handle.settle_skip()

    # ------------------------------------------------------------------ Apex's attributes
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def fp16_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the half model params (each has an FP32 master)."""
        return self._stash.fp16_groups

    @property
    def fp32_from_fp16_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the FP32 masters of `fp16_groups` (what the optimizer steps)."""
        return self._stash.fp32_from_fp16_groups

    @property
    def fp32_from_fp32_groups(self) -> list[list[torch.Tensor]]:
        """Per param group, the FP32 params (their own masters)."""
        return self._stash.fp32_from_fp32_groups

    @property
    def all_fp16_params(self) -> list[torch.Tensor]:
        return self._stash.all_fp16_params

    @property
    def all_fp32_from_fp16_params(self) -> list[torch.Tensor]:
        return self._stash.all_fp32_from_fp16_params

    @property
    def all_fp32_from_fp32_params(self) -> list[torch.Tensor]:
        return self._stash.all_fp32_from_fp32_params

    def _masters_state(self) -> list[list[torch.Tensor]]:
        return [[m.detach() for m in group] for group in self.fp32_from_fp16_groups]

    def _inner_state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's own state dict (without ampatch's masters entry: the
        wrapper saves the masters under Apex's key)."""
        sd = self.optimizer.state_dict()
        sd.pop(MASTERS_KEY, None)
        return sd

    def _load_masters(self, saved: Any, key: str, flat: bool = False) -> Callable[[], None]:
        """Check saved masters against this wrapper's (all of it, before anything is loaded);
        returns what loads them (and the half model params from them)."""
        current = [g["params"] for g in self.optimizer.param_groups] if flat else self.fp32_from_fp16_groups
        if not isinstance(saved, (list, tuple)) or len(saved) != len(current):
            raise ConfigError(f"{self.name}.load_state_dict: '{key}' has {_count(saved)} param groups, this optimizer "
                              f"{len(current)}; the checkpoint is from another model or optimizer. Nothing was loaded.")
        for i, (now, then) in enumerate(zip(current, saved)):
            if flat:
                ok = isinstance(then, torch.Tensor) and then.numel() == sum(p.numel() for p in now)
            else:
                ok = isinstance(then, (list, tuple)) and len(then) == len(now) and all(
                    isinstance(t, torch.Tensor) and t.shape == p.shape for p, t in zip(now, then))
            if not ok:
                raise ConfigError(f"{self.name}.load_state_dict: '{key}' group {i} does not match this optimizer's "
                                  "params (their number or shapes differ); the checkpoint is from another model or "
                                  "optimizer. Nothing was loaded.")

        def load() -> None:
            with torch.no_grad():
                for now, then in zip(current, saved):
                    if flat:
                        then = _unflatten_dense_tensors(then, now)
                    if now:
                        torch._foreach_copy_(list(now), [t.to(p.device) for p, t in zip(now, then)])
            self._handle.masters.copy_to_model()
        return load

    def __getstate__(self) -> Any:
        raise InvalidCallError(f"{self.name} should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise InvalidCallError(f"{self.name} should be deserialized using load_state_dict().")


def _count(value: Any) -> int | str:
    return len(value) if isinstance(value, (list, tuple)) else type(value).__name__
