"""`apex.parallel.distributed`: `DistributedDataParallel` (torch's, taking Apex's keywords; see
the package), and the helpers scripts call directly: collective calls on flattened buckets of
tensors, and Apex's manual `Reducer`, on `torch.distributed`.

`flat_dist_call(tensors, call, extra_args)` groups `tensors` by type, flattens each group into
one buffer, runs `call(buffer, *extra_args)` (`dist.broadcast`, `dist.all_reduce`, ...), divides
by the world size after an `all_reduce` (an average, as in Apex), and copies the result back
into the tensors. Any backend, any device.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...errors import ConfigError
from ..extensions.apex_C import flatten, unflatten
from .sync_batchnorm import SyncBatchNorm

__all__ = ["DistributedDataParallel", "ApexAllreduce", "apex_allreduce_hook", "flatten", "unflatten",
           "apply_flat_dist_call", "split_half_float_double", "split_by_type", "flat_dist_call", "extract_tensors",
           "Reducer", "import_flatten_impl"]

logger = logging.getLogger("ampatch")


def apply_flat_dist_call(bucket: Sequence[Tensor], call: Callable[..., Any], extra_args: Sequence[Any] | None = None
                         ) -> None:
    """`call` on one flat buffer of `bucket` (tensors of one type), then the result back into
    each tensor; after `dist.all_reduce` the sum is divided by the world size."""
    coalesced = flatten(bucket)
    if extra_args is not None:
        call(coalesced, *extra_args)
    else:
        call(coalesced)
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    with torch.no_grad():
        for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
            buf.copy_(synced)


def split_half_float_double(tensors: Iterable[Tensor]) -> list[list[Tensor]]:
    """The tensors in buckets by dtype, half first, then float and double (non-empty buckets
    only). Apex matched CUDA type names; here any device counts, and bfloat16 is a half too."""
    tensors = list(tensors)
    buckets = [[t for t in tensors if t.dtype == dtype]
               for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)]
    return [b for b in buckets if b]


def split_by_type(tensors: Iterable[Tensor]) -> OrderedDict[str, list[Tensor]]:
    """The tensors by `tensor.type()` ("torch.cuda.HalfTensor", "torch.FloatTensor", ...), in order of appearance."""
    buckets: OrderedDict[str, list[Tensor]] = OrderedDict()
    for tensor in tensors:
        buckets.setdefault(tensor.type(), []).append(tensor)
    return buckets


def flat_dist_call(tensors: Iterable[Tensor], call: Callable[..., Any], extra_args: Sequence[Any] | None = None
                   ) -> None:
    """`apply_flat_dist_call` for each type of tensor in `tensors`, e.g.
    `flat_dist_call([p.data for p in model.parameters()], dist.broadcast, (0,))`."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor: Any, tensor_list: list[Tensor]) -> None:
    """Append every tensor in a (nested) iterable to `tensor_list`."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    try:
        for item in maybe_tensor:
            extract_tensors(item, tensor_list)
    except TypeError:
        return


class Reducer:
    """`apex.parallel.Reducer(module_or_grads_list)`: averages gradients across processes when
    `reduce()` is called, not during backward (e.g. every few iterations). Given a module, it
    broadcasts the module's parameters from rank 0 first, as Apex's did."""

    def __init__(self, module_or_grads_list: nn.Module | Iterable[Any]) -> None:
        self.grads: list[Tensor] = []
        if isinstance(module_or_grads_list, nn.Module):
            self.module: nn.Module | None = module_or_grads_list
            flat_dist_call([p.data for p in self.module.parameters()], dist.broadcast, (0,))
        else:
            self.module = None
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        """All-reduce (average) the gradients: the module's current ones, or the list given."""
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
            flat_dist_call(grads, dist.all_reduce)
        else:
            flat_dist_call(self.grads, dist.all_reduce)


def import_flatten_impl() -> None:
    """Apex chose its flatten implementation here; ampatch's is `apex_C`'s (torch's own): nothing to do."""


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
            raise ConfigError("shared_param is no longer supported by Apex's DistributedDataParallel (Apex raised "
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
