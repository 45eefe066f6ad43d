"""`apex.parallel.optimized_sync_batchnorm`: Apex's fused-kernel `SyncBatchNorm`, here the same
class as `sync_batchnorm.SyncBatchNorm` (torch's SyncBatchNorm is the fused kernel)."""
from __future__ import annotations

from .sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
