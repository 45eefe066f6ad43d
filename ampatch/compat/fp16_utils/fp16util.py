"""`apex.fp16_utils.fp16util`: Apex's manual mixed-precision helpers (see the package)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ...base.tree import map_tensors
from ...errors import ConfigTypeError, InvalidCallError
from ..missing import not_provided_class

__all__ = ["to_python_float", "tofp16", "BN_convert_float", "network_to_half", "convert_module", "convert_network",
           "FP16Model", "FP16_Module", "fp32_to_fp16", "fp16_to_fp32", "prep_param_lists",
           "model_grads_to_master_grads", "master_params_to_model_params", "clip_grad_norm", "Fused_Weight_Norm",
           "backwards_debug_hook"]

clip_grad_norm = torch.nn.utils.clip_grad_norm_


def to_python_float(t: Any) -> float:
    """A one-element tensor (or a number) as a Python float."""
    return t.item() if hasattr(t, "item") else t[0]


class tofp16(nn.Module):  # noqa: N801 - Apex's name
    """A module whose forward returns `input.half()`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - Apex's name
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802 - Apex's name
    """Affine batch norms (recursively) back to FP32, for a model made half by `network_to_half`."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Module:
    """`nn.Sequential(tofp16(), network.half())` with batch norms kept in FP32."""
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """A module's own floating parameters and buffers (not its children's) to `dtype`."""
    module._apply(lambda t: t.to(dtype) if t.is_floating_point() else t, recurse=False)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every module to `dtype` except affine batch norms, which stay FP32 (Apex's rule); RNN
    weights are flattened again."""
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """`convert_network(network, torch.half)`, whose forward casts its inputs to half."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.network(*(t.half() for t in inputs))


def _convert(value: Any, source: tuple[torch.dtype, ...], target: torch.dtype) -> Any:
    """`value` (tensors nested in lists/tuples/dicts) with its tensors of a `source` dtype in `target`."""
    return map_tensors(value, lambda t: t.to(target) if t.dtype in source else t)


def fp32_to_fp16(value: Any) -> Any:
    """FP32 tensors (nested in lists/tuples) to half."""
    return _convert(value, (torch.float32,), torch.half)


def fp16_to_fp32(value: Any) -> Any:
    """Half tensors (nested in lists/tuples) to FP32."""
    return _convert(value, (torch.float16,), torch.float32)


class FP16_Module(nn.Module):  # noqa: N801 - Apex's name
    """`module.half()` that takes FP32 inputs and returns FP32 outputs."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module.half()  # a submodule, registered by nn.Module's __setattr__

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return fp16_to_fp32(self.module(*fp32_to_fp16(inputs), **kwargs))


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """`(model_params, master_params)`: the model's trainable params and FP32 copies of them
    (one flat FP32 tensor with `flat_master=True`, which needs params of one dtype)."""
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if len({p.dtype for p in model_params}) > 1:
            raise ConfigTypeError("prep_param_lists(flat_master=True) needs parameters of one dtype; the model mixes "
                                  f"{sorted({str(p.dtype) for p in model_params})}. Use flat_master=False.")
        master = nn.Parameter(_flatten_dense_tensors([p.detach() for p in model_params]).float())
        master.grad = torch.empty_like(master)
        return model_params, [master]
    masters = [nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(model_params: list[torch.Tensor], master_params: list[torch.Tensor],
                                flat_master: bool = False) -> None:
    """Copy the model's gradients into the FP32 masters' (None stays None)."""
    if flat_master:
        flat = master_params[0].grad
        assert flat is not None, "prep_param_lists(flat_master=True) gives the flat master a gradient"
        flat.copy_(_flatten_dense_tensors([p.grad for p in model_params]))
        return
    src, dst = [], []
    for model, master in zip(model_params, master_params):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        src.append(model.grad)
        dst.append(master.grad)
    if dst:
        torch._foreach_copy_(dst, src)


def master_params_to_model_params(model_params: list[torch.Tensor], master_params: list[torch.Tensor],
                                  flat_master: bool = False) -> None:
    """Copy the FP32 masters (views of the flat one with `flat_master=True`) into the model's parameters."""
    with torch.no_grad():
        if flat_master:
            master_params = _unflatten_dense_tensors(master_params[0], model_params)
        if model_params:
            torch._foreach_copy_(list(model_params), list(master_params))


Fused_Weight_Norm = not_provided_class(  # noqa: N816 - Apex's name
    "Fused_Weight_Norm", __name__, "apex.fp16_utils.Fused_Weight_Norm is a CUDA kernel ampatch does not provide; use "
    "torch.nn.utils.parametrizations.weight_norm.")


def backwards_debug_hook(grad: torch.Tensor) -> None:
    """Apex's debugging hook for FP32 masters: a gradient reaching one is a bug (it raises)."""
    raise InvalidCallError("master_params received a gradient in the backward pass: the FP32 masters should get their "
                           "gradients copied from the model (model_grads_to_master_grads), not from autograd.")
