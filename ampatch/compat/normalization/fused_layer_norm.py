"""`apex.normalization.fused_layer_norm`: `torch.nn.LayerNorm` / `torch.nn.RMSNorm` with Apex's
constructors (`eps=1e-5`, `elementwise_affine=True`, `memory_efficient=False`), Apex's functional
forms, and its autograd Functions (`FusedLayerNormAffineFunction.apply(input, weight, bias,
normalized_shape, eps)`, which NVIDIA's BERT calls, and the others), all on torch's kernels.

`memory_efficient` only chose what Apex's kernel saved for the backward pass; the results
are the same, so it is accepted (and kept as an attribute by the modules). The mixed-dtype
variants (`MixedFused*`, `mixed_dtype_*`, `*MixedDtypesFunction`) compute in FP32 with FP32
weights and return the input's dtype, as Apex's did.

The Functions' values and gradients are those of the functional forms, which call
`F.layer_norm` / `F.rms_norm`: whatever ampatch's O1 does to those (FP32) it does inside the
Functions too, and each gradient comes back in its tensor's dtype.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ampatch.errors import ConfigError

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm", "fused_layer_norm_affine",
           "fused_layer_norm", "mixed_dtype_fused_layer_norm_affine", "fused_rms_norm_affine", "fused_rms_norm",
           "mixed_dtype_fused_rms_norm_affine", "manual_rms_norm", *(
               f"Fused{kind}{suffix}Function" for kind in ("LayerNorm", "RMSNorm")
               for suffix in ("Affine", "AffineMixedDtypes", ""))]


class _ApexConstructor:
    """Apex's constructor over a torch norm: `eps=1e-5` (torch's RMSNorm defaults to None),
    and `memory_efficient` kept as an attribute."""

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False, **torch_kwargs: Any) -> None:
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,  # type: ignore[call-arg]
                         **torch_kwargs)
        self.memory_efficient = memory_efficient


class FusedLayerNorm(_ApexConstructor, nn.LayerNorm):
    """`apex.normalization.FusedLayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True)`."""


class FusedRMSNorm(_ApexConstructor, nn.RMSNorm):
    """`apex.normalization.FusedRMSNorm(normalized_shape, eps=1e-5, elementwise_affine=True)`."""


def _affine_only(name: str, kwargs: dict) -> None:
    if not kwargs.pop("elementwise_affine", True):
        raise ConfigError(f"{name} needs elementwise_affine=True (as in Apex); use "
                          f"{name.removeprefix('Mixed')}(elementwise_affine=False) instead.")


class MixedFusedLayerNorm(FusedLayerNorm):
    """Layer norm computed in FP32 with FP32 weights, output in the input's dtype."""

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, **kwargs: Any) -> None:
        _affine_only("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, **kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        return F.layer_norm(input.float(), self.normalized_shape, self.weight.float(), self.bias.float(),
                            self.eps).to(input.dtype)


class MixedFusedRMSNorm(FusedRMSNorm):
    """RMS norm computed in FP32 with FP32 weights, output in the input's dtype."""

    def __init__(self, normalized_shape: Any, eps: float = 1e-5, **kwargs: Any) -> None:
        _affine_only("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape, eps=eps, elementwise_affine=True, **kwargs)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        return F.rms_norm(input.float(), self.normalized_shape, self.weight.float(), self.eps).to(input.dtype)


# Apex's functional forms, on torch's kernels (`memory_efficient` changed only what Apex saved
# for the backward pass). The mixed-dtype forms compute in FP32 and return the input's dtype.
def fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,  # noqa: A002
                            normalized_shape: Any, eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    return F.layer_norm(input, _shape(normalized_shape), weight, bias, eps)


def fused_layer_norm(input: torch.Tensor, normalized_shape: Any, eps: float = 1e-6,  # noqa: A002
                     memory_efficient: bool = False) -> torch.Tensor:
    return F.layer_norm(input, _shape(normalized_shape), None, None, eps)


def mixed_dtype_fused_layer_norm_affine(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,  # noqa: A002
                                        normalized_shape: Any, eps: float = 1e-6,
                                        memory_efficient: bool = False) -> torch.Tensor:
    return F.layer_norm(input.float(), _shape(normalized_shape), weight.float(), bias.float(), eps).to(input.dtype)


def fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor, normalized_shape: Any,  # noqa: A002
                          eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    return F.rms_norm(input, _shape(normalized_shape), weight, eps)


def fused_rms_norm(input: torch.Tensor, normalized_shape: Any, eps: float = 1e-6,  # noqa: A002
                   memory_efficient: bool = False) -> torch.Tensor:
    return F.rms_norm(input, _shape(normalized_shape), None, eps)


def mixed_dtype_fused_rms_norm_affine(input: torch.Tensor, weight: torch.Tensor, normalized_shape: Any,  # noqa: A002
                                      eps: float = 1e-6, memory_efficient: bool = False) -> torch.Tensor:
    return F.rms_norm(input.float(), _shape(normalized_shape), weight.float(), eps).to(input.dtype)


def manual_rms_norm(input: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None,  # noqa: A002
                    eps: float) -> torch.Tensor:
    """Apex's unfused reference RMS norm: computed in FP32, returned in the input's dtype."""
    return F.rms_norm(input.float(), _shape(normalized_shape), None if weight is None else weight.float(),
                      eps).to(input.dtype)


def _shape(normalized_shape: Any) -> tuple[int, ...]:
    return (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)


# Apex's autograd Functions ran its CUDA kernels; here each runs the functional form above. The
# forward records that form's own autograd graph on detached copies of the tensor arguments and
# returns its output; the backward differentiates that graph, so values, gradients and their
# dtypes are exactly the form's (O1's casts included), and what is kept for the backward pass is
# what the form itself keeps.
class _OnTorchForm(torch.autograd.Function):
    """Base of the Functions: `_forward` from each one's `forward`, with Apex's signature."""

    @staticmethod
    def _forward(ctx: Any, form: Any, tensors: tuple, args: tuple) -> torch.Tensor:
        ctx.form, ctx.args = form, args
        ctx.save_for_backward(*tensors)
        ctx.graph = _record(form, tensors, args, ctx.needs_input_grad)
        return ctx.graph[0].detach()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        tensors = ctx.saved_tensors  # raises as torch does after the graph was freed or changed
        graph, ctx.graph = ctx.graph, None  # the graph goes with this backward pass ...
        if graph is None:  # ... so a second one (retain_graph=True) records it again
            graph = _record(ctx.form, tensors, ctx.args, ctx.needs_input_grad)
        out, leaves = graph
        wanted = [leaf for leaf in leaves if leaf is not None and leaf.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_output, allow_unused=True) if wanted else ())
        return (*(next(grads) if leaf is not None and leaf.requires_grad else None for leaf in leaves),
                *(None,) * (len(ctx.needs_input_grad) - len(leaves)))


def _record(form: Any, tensors: tuple, args: tuple, needs_grad: tuple) -> tuple[torch.Tensor, list]:
    """`form(*tensors, *args)` on detached copies that require grad where the caller's do."""
    leaves = [None if t is None else t.detach().requires_grad_(bool(need))
              for t, need in zip(tensors, needs_grad)]
    with torch.enable_grad():
        return form(*leaves, *args), leaves


class FusedLayerNormAffineFunction(_OnTorchForm):
    """`apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)`: `fused_layer_norm_affine`."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,  # noqa: A002
                normalized_shape: Any, eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return _OnTorchForm._forward(ctx, fused_layer_norm_affine, (input, weight, bias), (normalized_shape, eps))


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """`apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)`:
    `mixed_dtype_fused_layer_norm_affine` (FP32, the input's dtype out)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,  # noqa: A002
                normalized_shape: Any, eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return _OnTorchForm._forward(ctx, mixed_dtype_fused_layer_norm_affine, (input, weight, bias),
                                     (normalized_shape, eps))


class FusedLayerNormFunction(_OnTorchForm):
    """`apply(input, normalized_shape, eps, memory_efficient=False)`: `fused_layer_norm`."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, normalized_shape: Any, eps: float,  # noqa: A002
                memory_efficient: bool = False) -> torch.Tensor:
        return _OnTorchForm._forward(ctx, fused_layer_norm, (input,), (normalized_shape, eps))


class FusedRMSNormAffineFunction(_OnTorchForm):
    """`apply(input, weight, normalized_shape, eps, memory_efficient=False)`: `fused_rms_norm_affine`."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, normalized_shape: Any,  # noqa: A002
                eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return _OnTorchForm._forward(ctx, fused_rms_norm_affine, (input, weight), (normalized_shape, eps))


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """`apply(input, weight, normalized_shape, eps, memory_efficient=False)`:
    `mixed_dtype_fused_rms_norm_affine` (FP32, the input's dtype out)."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, weight: torch.Tensor, normalized_shape: Any,  # noqa: A002
                eps: float, memory_efficient: bool = False) -> torch.Tensor:
        return _OnTorchForm._forward(ctx, mixed_dtype_fused_rms_norm_affine, (input, weight), (normalized_shape, eps))


class FusedRMSNormFunction(_OnTorchForm):
    """`apply(input, normalized_shape, eps, memory_efficient=False)`: `fused_rms_norm`."""

    @staticmethod
    def forward(ctx: Any, input: torch.Tensor, normalized_shape: Any, eps: float,  # noqa: A002
                memory_efficient: bool = False) -> torch.Tensor:
        return _OnTorchForm._forward(ctx, fused_rms_norm, (input,), (normalized_shape, eps))
