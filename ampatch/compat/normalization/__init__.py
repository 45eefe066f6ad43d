"""`apex.normalization` under the alias: `torch.nn.LayerNorm` / `torch.nn.RMSNorm` with Apex's
constructors (`fused_layer_norm`), and `InstanceNorm3dNVFuser` (`instance_norm`, not provided)."""
from __future__ import annotations

from .fused_layer_norm import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm
from .instance_norm import InstanceNorm3dNVFuser

__all__ = ["FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm", "InstanceNorm3dNVFuser"]
