"""`apex.optimizers` under the alias: torch.optim's implementations with Apex's names,
keyword arguments and defaults, using `fused=True` on CUDA and `foreach=True` elsewhere.

PyTorch has no LAMB and no NovoGrad: `FusedLAMB`, `FusedMixedPrecisionLamb` and
`FusedNovoGrad` are importable (scripts import them unconditionally) and raise a clear error
naming the alternatives when constructed. Apex options torch cannot honour raise too.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .alias import not_provided_class

logger = logging.getLogger("ampatch")

__all__ = ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad",
           "FP16_Optimizer"]


def _params_list(params: Iterable[Any]) -> list[Any]:
    """The params argument as a list, each group's params a list (a generator is read once)."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of Tensors or dicts, "
                        "but got a Tensor.")
    out = []
    for item in params:
        if isinstance(item, dict):
            group = item["params"]
            item = dict(item, params=[group] if isinstance(group, torch.Tensor) else list(group))
        out.append(item)
    return out


def _fast_path(params: list[Any]) -> dict[str, bool]:
    """`fused=True` when every parameter is on CUDA, else `foreach=True` (multi-tensor)."""
    tensors: list[Any] = []
    for item in params:
        tensors.extend(item["params"] if isinstance(item, dict) else [item])
    tensors = [t[1] if isinstance(t, tuple) else t for t in tensors]  # (name, param) pairs
    if tensors and all(t.device.type == "cuda" and t.is_floating_point() for t in tensors):
        return {"fused": True}
    return {"foreach": True}


def _deprecated_step_args(name: str, **kwargs: Any) -> None:
    if any(v is not None for v in kwargs.values()):
        raise RuntimeError(f"{name} has been updated (as in Apex): initialize it identically to torch.optim and "
                           "call step() with no arguments.")


class _SetGradNone:
    """Apex's `set_grad_none`: what `zero_grad()` does when not told (`set_to_none`)."""

    set_grad_none: bool

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)  # type: ignore[misc]


class FusedAdam(_SetGradNone, torch.optim.Adam):
    """`apex.optimizers.FusedAdam`: Apex's defaults are AdamW semantics (`adam_w_mode=True`,
    decoupled weight decay) and `zero_grad()` setting grads to None (`set_grad_none=True`);
    `adam_w_mode=False` is Adam with L2 weight decay."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True,
                 capturable: bool = False, master_weights: bool = False) -> None:
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant (neither did Apex's); use "
                               "torch.optim.AdamW(amsgrad=True).")
        if not bias_correction:
            raise NotImplementedError("FusedAdam(bias_correction=False): torch.optim.Adam always corrects the "
                                      "moment estimates' bias and has no switch for it; drop the argument.")
        if master_weights:
            raise NotImplementedError("FusedAdam(master_weights=True) kept Apex's own FP32 copies; with ampatch, "
                                      "use amp.initialize(model, optimizer, opt_level='O2'), which gives any "
                                      "optimizer FP32 master weights.")
        params = _params_list(params)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=capturable,
                         decoupled_weight_decay=adam_w_mode, **_fast_path(params))
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none

    def step(self, closure: Callable[[], Any] | None = None, grads: Any = None, output_params: Any = None,
             scale: Any = None, grad_norms: Any = None, grad_scaler: Any = None) -> Any:
        _deprecated_step_args("FusedAdam", grads=grads, output_params=output_params, scale=scale,
                              grad_norms=grad_norms, grad_scaler=grad_scaler)
        return super().step(closure)


class FusedSGD(_SetGradNone, torch.optim.SGD):
    """`apex.optimizers.FusedSGD`: `lr` is required and `zero_grad()` zeroes in place
    (`set_grad_none=False`), as in Apex."""

    def __init__(self, params: Iterable[Any], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, wd_after_momentum: bool = False,
                 materialize_master_grads: bool = True, set_grad_none: bool = False) -> None:
        if wd_after_momentum:
            raise NotImplementedError("FusedSGD(wd_after_momentum=True): torch.optim.SGD adds weight decay before "
                                      "momentum and has no switch for the other order; drop the argument.")
        if not materialize_master_grads:
            logger.info("ampatch: FusedSGD(materialize_master_grads=False) only changed where Apex kept O2 master "
                        "gradients; ampatch always keeps them on the FP32 masters (same result). Ignored.")
        params = _params_list(params)
        super().__init__(params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, **_fast_path(params))
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.set_grad_none = set_grad_none


class FusedAdagrad(_SetGradNone, torch.optim.Adagrad):
    """`apex.optimizers.FusedAdagrad` as `torch.optim.Adagrad` (foreach)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0.0,
                 set_grad_none: bool = True, adagrad_w_mode: bool = False) -> None:
        if adagrad_w_mode:
            raise NotImplementedError("FusedAdagrad(adagrad_w_mode=True): torch.optim.Adagrad has no decoupled "
                                      "weight decay; use weight_decay (L2) or torch.optim.AdamW.")
        super().__init__(params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=True)
        self.set_grad_none = set_grad_none


def _unavailable(name: str, algorithm: str, alternatives: str) -> type:
    """An optimizer class PyTorch does not have: importable, raises naming the alternatives."""
    return not_provided_class(name, __name__, f"apex.optimizers.{name}: PyTorch has no {algorithm} optimizer and "
                              f"ampatch does not re-implement Apex's fused kernel. Alternatives: {alternatives}. Any "
                              "torch.optim.Optimizer works with amp.initialize.", base=torch.optim.Optimizer)


_LAMB_ALTERNATIVES = ("torch.optim.AdamW(fused=True) (Adam without LAMB's layer-wise trust ratio), or a LAMB "
                      "implementation such as torch-optimizer's Lamb (pip install torch-optimizer)")
FusedLAMB = _unavailable("FusedLAMB", "LAMB", _LAMB_ALTERNATIVES)
FusedMixedPrecisionLamb = _unavailable("FusedMixedPrecisionLamb", "LAMB", _LAMB_ALTERNATIVES)
FusedNovoGrad = _unavailable("FusedNovoGrad", "NovoGrad",
                             "torch.optim.AdamW(fused=True), or a NovoGrad implementation such as "
                             "torch-optimizer's NovoGrad (pip install torch-optimizer)")

# Apex's deprecated FP16 wrapper (also apex.fp16_utils.FP16_Optimizer): amp.initialize does its job.
FP16_Optimizer = not_provided_class(  # noqa: N816 - Apex's name
    "FP16_Optimizer", __name__,
    "FP16_Optimizer is Apex's deprecated manual-master-weights wrapper and is not provided. Use amp "
    "instead:\n    model, optimizer = amp.initialize(model, optimizer, opt_level='O2')\n"
    "    with amp.scale_loss(loss, optimizer) as scaled_loss:\n        scaled_loss.backward()\n"
    "    optimizer.step()\n(FP32 master weights and dynamic loss scaling included.)")
