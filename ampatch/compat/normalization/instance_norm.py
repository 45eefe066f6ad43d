"""`apex.normalization.instance_norm`: Apex's nvFuser instance norm. Not provided (it needed
nvFuser): importable, and constructing it raises naming `torch.nn.InstanceNorm3d`."""
from __future__ import annotations

from ..missing import not_provided_class

__all__ = ["InstanceNorm3dNVFuser"]

InstanceNorm3dNVFuser = not_provided_class(
    "InstanceNorm3dNVFuser", __name__, "apex.normalization.InstanceNorm3dNVFuser needed nvFuser and is not provided "
    "by ampatch; use torch.nn.InstanceNorm3d (torch.compile fuses it).")
