"""`apex.multi_tensor_apply` under the alias: Apex's applier, driving the `amp_C` kernels that
ampatch computes with torch's foreach ops (`ampatch.compat.extensions.amp_C`)."""
from __future__ import annotations

from .multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
