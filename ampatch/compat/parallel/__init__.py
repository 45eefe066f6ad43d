"""`apex.parallel` under the alias: PyTorch's data parallelism with Apex's names and keywords.

- `DistributedDataParallel` is `torch.nn.parallel.DistributedDataParallel` taking Apex's keyword
  arguments: `message_size` sets the bucket size, `allreduce_always_fp32`,
  `gradient_predivide_factor` and `gradient_average=False` reduce as Apex did (a DDP
  communication hook); those that only tuned Apex's own streams and buckets have no meaning for
  torch's DDP (which buckets and overlaps its all-reduce itself) and are ignored, logged once.
- `Reducer`, `flat_dist_call`, `apply_flat_dist_call`, `split_by_type`, ... (`distributed`):
  Apex's manual all-reduce helpers (also under `apex.parallel.distributed`).
- `SyncBatchNorm` is `torch.nn.SyncBatchNorm` with Apex's constructor. On CPU under
  `torch.distributed`, where torch's SyncBatchNorm has no kernel, the batch statistics are
  summed across ranks with a differentiable `torch.distributed.all_reduce`.
- `convert_syncbn_model` swaps every batch norm for that `SyncBatchNorm`;
  `create_syncbn_process_group(group_size)` makes the groups of ranks it syncs within.
- `LARC` (the `apex.parallel.LARC` module) wraps a torch optimizer, as Apex's did.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...errors import ConfigError
from . import LARC  # noqa: N812 - in Apex, apex.parallel.LARC is a module
from .distributed import (
    ApexAllreduce,
    DistributedDataParallel,
    Reducer,
    apex_allreduce_hook,
    apply_flat_dist_call,
    extract_tensors,
    flat_dist_call,
    flatten,
    split_by_type,
    split_half_float_double,
    unflatten,
)
from .sync_batchnorm import SyncBatchNorm

__all__ = ["DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
           "create_syncbn_process_group", "LARC", "ApexAllreduce", "apex_allreduce_hook", "flat_dist_call",
           "apply_flat_dist_call", "split_by_type", "split_half_float_double", "extract_tensors", "flatten",
           "unflatten", "ReduceOp"]

ReduceOp = dist.ReduceOp  # Apex re-exported torch's


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
        raise ConfigError(f"create_syncbn_process_group: group_size {group_size} must divide the world size "
                          f"{world_size}.")
    group = None
    for group_num in range(world_size // group_size):
        ranks = list(range(group_num * group_size, (group_num + 1) * group_size))
        current = dist.new_group(ranks=ranks)
        if dist.get_rank() // group_size == group_num:
            group = current
    return group
