"""`apex.parallel.sync_batchnorm`: `SyncBatchNorm` as `torch.nn.SyncBatchNorm` with Apex's
constructor. On CPU under `torch.distributed`, where torch's SyncBatchNorm has no kernel, the
batch statistics are summed across ranks with a differentiable `torch.distributed.all_reduce`."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ampatch.errors import NotSupportedError

__all__ = ["SyncBatchNorm"]


class _SumAcrossRanks(torch.autograd.Function):
    """all_reduce(SUM) whose gradient is the all_reduce(SUM) of the incoming gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SyncBatchNorm(nn.SyncBatchNorm):
    """`apex.parallel.SyncBatchNorm(num_features, eps, momentum, affine, track_running_stats,
    process_group, channel_last, fuse_relu)` as `torch.nn.SyncBatchNorm`."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any = None, channel_last: bool = False,
                 fuse_relu: bool = False, **torch_kwargs: Any) -> None:
        if channel_last:
            raise NotSupportedError("SyncBatchNorm(channel_last=True) is Apex's NHWC kernel; torch's "
                                    "SyncBatchNorm takes channels-last tensors as they are: keep the input in "
                                    "NCHW shape with memory_format=torch.channels_last and drop channel_last.")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, process_group, **torch_kwargs)
        self.fuse_relu = fuse_relu

    def _syncs_on_cpu(self, x: torch.Tensor) -> bool:
        return (self.training and x.device.type == "cpu" and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.process_group or dist.group.WORLD) > 1)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's name
        if input.device.type != "cpu":
            out = super().forward(input)
        elif self._syncs_on_cpu(input):
            out = self._cpu_forward(input)
        else:  # one rank or no process group: torch's SyncBatchNorm would refuse a CPU tensor
            out = nn.modules.batchnorm._BatchNorm.forward(self, input)
        return F.relu(out) if self.fuse_relu else out

    def _cpu_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Batch statistics summed over the ranks (torch's SyncBatchNorm kernel is GPU-only)."""
        self._check_input_dim(x)
        c = x.shape[1]
        dims = [0, *range(2, x.dim())]
        xf = x.float()
        count = torch.full((1,), x.numel() / c, dtype=torch.float32)
        total = _SumAcrossRanks.apply(torch.cat([xf.sum(dims), (xf * xf).sum(dims), count]),
                                      self.process_group or dist.group.WORLD)
        n = total[-1]
        mean = total[:c] / n
        var = (total[c:2 * c] / n - mean * mean).clamp_min(0.0)
        shape = [1, c] + [1] * (x.dim() - 2)
        out = (xf - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            out = out * self.weight.float().view(shape) + self.bias.float().view(shape)
        if self.track_running_stats:
            tracked, running_mean, running_var = self.num_batches_tracked, self.running_mean, self.running_var
            assert tracked is not None and running_mean is not None and running_var is not None  # as torch's own
            with torch.no_grad():
                tracked.add_(1)
                factor = self.momentum if self.momentum is not None else 1.0 / float(tracked)
                unbiased = var * (n / (n - 1).clamp_min(1.0))
                running_mean.lerp_(mean.to(running_mean.dtype), factor)
                running_var.lerp_(unbiased.to(running_var.dtype), factor)
        return out.to(x.dtype)
