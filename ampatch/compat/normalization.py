"""`apex.normalization` under the alias: `torch.nn.LayerNorm` / `torch.nn.RMSNorm` with Apex's
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

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm"]


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
