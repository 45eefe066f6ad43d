"""The helpers of `apex.parallel.distributed` that scripts call directly: collective calls on
flattened buckets of tensors, and Apex's manual `Reducer`, on `torch.distributed`.

`flat_dist_call(tensors, call, extra_args)` groups `tensors` by type, flattens each group into
one buffer, runs `call(buffer, *extra_args)` (`dist.broadcast`, `dist.all_reduce`, ...), divides
by the world size after an `all_reduce` (an average, as in Apex), and copies the result back
into the tensors. Any backend, any device.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .apex_c import flatten, unflatten

__all__ = ["flatten", "unflatten", "apply_flat_dist_call", "split_half_float_double", "split_by_type",
           "flat_dist_call", "extract_tensors", "Reducer"]


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
