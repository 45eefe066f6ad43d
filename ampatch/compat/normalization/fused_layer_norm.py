"""`apex.normalization.fused_layer_norm`: `torch.nn.LayerNorm` / `torch.nn.RMSNorm` with Apex's
constructors (`eps=1e-5`, `elementwise_affine=True`, `memory_efficient=False`).

`memory_efficient` only chose what Apex's kernel saved for the backward pass; the results
are the same, so it is accepted and kept as an attribute. The `MixedFused*` variants keep
FP32 weights and return the input's dtype, as Apex's did.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..missing import not_provided_class

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
        raise ValueError(f"{name} needs elementwise_affine=True (as in Apex); use "
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


# Apex's autograd Functions ran its CUDA kernels; the functions above are their torch forms.
for _kind, _fn in (("LayerNorm", "fused_layer_norm"), ("RMSNorm", "fused_rms_norm")):
    for _suffix, _call in (("Affine", f"{_fn}_affine"), ("AffineMixedDtypes", f"mixed_dtype_{_fn}_affine"), ("", _fn)):
        _name = f"Fused{_kind}{_suffix}Function"
        globals()[_name] = not_provided_class(
            _name, __name__, f"apex.normalization.fused_layer_norm.{_name} ran Apex's CUDA kernel and is not provided "
            f"by ampatch; call apex.normalization.fused_layer_norm.{_call} (torch.nn.functional's kernel) instead.")
del _kind, _fn, _suffix, _call, _name
