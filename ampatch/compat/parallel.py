"""`apex.parallel` under the alias: PyTorch's data parallelism with Apex's names and keywords.

- `DistributedDataParallel` is `torch.nn.parallel.DistributedDataParallel` taking Apex's keyword
  arguments: `message_size` sets the bucket size, `allreduce_always_fp32`,
  `gradient_predivide_factor` and `gradient_average=False` reduce as Apex did (a DDP
  communication hook); those that only tuned Apex's own streams and buckets have no meaning for
  torch's DDP (which buckets and overlaps its all-reduce itself) and are ignored, logged once.
- `Reducer`, `flat_dist_call`, `apply_flat_dist_call`, `split_by_type`, ... (`flat_dist`):
  Apex's manual all-reduce helpers (also under `apex.parallel.distributed`).
- `SyncBatchNorm` is `torch.nn.SyncBatchNorm` with Apex's constructor. On CPU under
  `torch.distributed`, where torch's SyncBatchNorm has no kernel, the batch statistics are
  summed across ranks with a differentiable `torch.distributed.all_reduce`.
- `convert_syncbn_model` swaps every batch norm for that `SyncBatchNorm`;
  `create_syncbn_process_group(group_size)` makes the groups of ranks it syncs within.
- `LARC` (the `apex.parallel.LARC` module) wraps a torch optimizer, as Apex's did.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import larc as LARC  # noqa: N812 - in Apex, apex.parallel.LARC is a module
from .flat_dist import (Reducer, apply_flat_dist_call, extract_tensors, flat_dist_call, flatten,
                        split_by_type, split_half_float_double, unflatten)

logger = logging.getLogger("ampatch")

__all__ = ["DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
           "create_syncbn_process_group", "LARC", "ApexAllreduce", "apex_allreduce_hook", "flat_dist_call",
           "apply_flat_dist_call", "split_by_type", "split_half_float_double", "extract_tensors", "flatten",
           "unflatten"]

# Apex's keyword arguments that only tuned Apex's own all-reduce machinery (streams, buckets,
# timing): torch's DDP buckets and overlaps its all-reduce itself and the gradients are the same.
_NO_EFFECT = {"delay_allreduce": False, "allreduce_trigger_params": None, "retain_allreduce_buffers": False,
              "num_allreduce_streams": 1, "allreduce_communicators": None, "prof": False}
_DEFAULT_MESSAGE_SIZE = 10000000
_logged: set[str] = set()


def _log_once(message: str, *args: Any) -> None:
    key = message % args
    if key not in _logged:
        _logged.add(key)
        logger.info(message, *args)


@dataclass(frozen=True)
class ApexAllreduce:
    """How Apex all-reduced a gradient bucket: in FP32 (`allreduce_always_fp32`), divided by
    `gradient_predivide_factor` before the sum and by `world_size / predivide` after it (the
    mean, with less overflow risk in half), or summed without the division
    (`gradient_average=False`). The state of `apex_allreduce_hook`."""

    group: Any
    always_fp32: bool
    predivide: float
    average: bool


def apex_allreduce_hook(state: ApexAllreduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that reduces each bucket the way Apex's DDP did (`ApexAllreduce`)."""
    buf = bucket.buffer()
    tensor = buf.float() if state.always_fp32 else buf
    if state.predivide != 1.0:
        tensor.mul_(1.0 / state.predivide)
    world = dist.get_world_size(state.group)
    future = dist.all_reduce(tensor, group=state.group, async_op=True).get_future()

    def finish(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = done.value()[0]
        if state.average:
            out.mul_(state.predivide / world)
        if out is not buf:
            buf.copy_(out)
        return buf

    return future.then(finish)


# torch's register_comm_hook compares these annotations with the real types (postponed
# annotations would be strings here)
apex_allreduce_hook.__annotations__ = {"state": ApexAllreduce, "bucket": dist.GradBucket,
                                       "return": torch.futures.Future[torch.Tensor]}


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """`apex.parallel.DistributedDataParallel(module, message_size=..., delay_allreduce=..., ...)`
    as torch's DistributedDataParallel. `message_size` (elements) becomes `bucket_cap_mb`;
    `allreduce_always_fp32`, `gradient_predivide_factor` (`gradient_average_split_factor`, its
    old name) and `gradient_average=False` reduce as in Apex (`apex_allreduce_hook`); the
    keywords that only tuned Apex's own all-reduce are accepted and have no effect (logged once);
    torch keyword arguments (`device_ids`, `find_unused_parameters`, ...) pass through."""

    def __init__(self, module: nn.Module, message_size: int = _DEFAULT_MESSAGE_SIZE, delay_allreduce: bool = False,
                 shared_param: Any = None, allreduce_trigger_params: Any = None,
                 retain_allreduce_buffers: bool = False, allreduce_always_fp32: bool = False,
                 num_allreduce_streams: int = 1, allreduce_communicators: Any = None, gradient_average: bool = True,
                 gradient_predivide_factor: float = 1.0, gradient_average_split_factor: Any = None,
                 prof: bool = False, **torch_kwargs: Any) -> None:
        if shared_param is not None:
            raise ValueError("shared_param is no longer supported by Apex's DistributedDataParallel (Apex raised "
                             "too); torch's DistributedDataParallel handles shared parameters: drop the argument.")
        given = {k: v for k, v in locals().items() if k in _NO_EFFECT}  # the arguments named in _NO_EFFECT
        ignored = [k for k, v in given.items() if v is not _NO_EFFECT[k] and v != _NO_EFFECT[k]]
        if ignored:
            _log_once("ampatch: apex.parallel.DistributedDataParallel: %s tune Apex's own all-reduce and have no "
                      "meaning for torch.nn.parallel.DistributedDataParallel (the gradients are the same); "
                      "ignored.", ", ".join(f"{k}={given[k]!r}" for k in ignored))
        if gradient_average_split_factor is not None:  # Apex's old name, which it still honoured
            gradient_predivide_factor = gradient_average_split_factor
        if message_size != _DEFAULT_MESSAGE_SIZE:
            torch_kwargs.setdefault("bucket_cap_mb", message_size * 4 / 2 ** 20)  # elements of FP32
        if "device_ids" not in torch_kwargs:
            device = next((p.device for p in module.parameters()), None)
            if device is not None and device.type == "cuda":  # Apex: one GPU per process, the module's
                torch_kwargs["device_ids"] = [device.index if device.index is not None
                                              else torch.cuda.current_device()]
        super().__init__(module, **torch_kwargs)
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.gradient_average = gradient_average
        if allreduce_always_fp32 or gradient_predivide_factor != 1.0 or not gradient_average:
            self.register_comm_hook(ApexAllreduce(self.process_group, allreduce_always_fp32,
                                                  float(gradient_predivide_factor), gradient_average),
                                    apex_allreduce_hook)

    def _passing_sync_batchnorm_handle(self, module: nn.Module) -> None:
        """torch refuses SyncBatchNorm in a CPU module; this module's SyncBatchNorm syncs on CPU
        too, so only other sync batch norms are refused."""
        if all(isinstance(m, SyncBatchNorm) for m in module.modules() if isinstance(m, nn.SyncBatchNorm)):
            return
        super()._passing_sync_batchnorm_handle(module)

    def disable_allreduce(self) -> None:
        """Apex's switch for gradient accumulation: the next backward passes skip the all-reduce
        (torch's `no_sync()` in method form)."""
        self.require_backward_grad_sync = False

    def enable_allreduce(self) -> None:
        """Undo `disable_allreduce()`: the next backward all-reduces the accumulated gradients."""
        self.require_backward_grad_sync = True


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
            raise NotImplementedError("SyncBatchNorm(channel_last=True) is Apex's NHWC kernel; torch's "
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
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (n / (n - 1).clamp_min(1.0))
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)
        return out.to(x.dtype)


def convert_syncbn_model(module: nn.Module, process_group: Any = None, channel_last: bool = False) -> nn.Module:
    """Every batch norm in `module` becomes a `SyncBatchNorm` sharing its parameters and
    running statistics (Apex's function, done as torch's `convert_sync_batchnorm`)."""
    out = module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
        out = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last)
        if module.affine:
            with torch.no_grad():
                out.weight = module.weight
                out.bias = module.bias
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.training = module.training
    for name, child in module.named_children():
        out.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return out


def create_syncbn_process_group(group_size: int) -> Any:
    """The process group of this rank's block of `group_size` consecutive ranks (None for 0:
    the whole world), for `SyncBatchNorm(process_group=...)`; every rank must call it."""
    if group_size == 0:
        return None
    world_size = dist.get_world_size()
    if group_size > world_size or world_size % group_size:
        raise ValueError(f"create_syncbn_process_group: group_size {group_size} must divide the world size "
                         f"{world_size}.")
    group = None
    for group_num in range(world_size // group_size):
        ranks = list(range(group_num * group_size, (group_num + 1) * group_size))
        current = dist.new_group(ranks=ranks)
        if dist.get_rank() // group_size == group_num:
            group = current
    return group
