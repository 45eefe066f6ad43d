"""`apex.parallel.sync_batchnorm_kernel`: Apex's autograd function behind its
SyncBatchNorm. Not provided (it ran Apex's own kernels): importable, and using it raises
naming the replacement."""
from __future__ import annotations

from ..missing import not_provided_class

__all__ = ["SyncBatchnormFunction"]

SyncBatchnormFunction = not_provided_class(
    "SyncBatchnormFunction", __name__, "apex.parallel.sync_batchnorm_kernel.SyncBatchnormFunction ran Apex's "
    "own kernels and is not provided by ampatch; use the module apex.parallel.SyncBatchNorm (torch.nn.SyncBatchNorm).")
