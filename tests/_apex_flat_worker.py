"""One rank of tests/compat/test_apex_parallel_helpers.py: Apex's `flat_dist_call` helpers, `Reducer`
and DDP keywords on a gloo group.

    python tests/_apex_flat_worker.py RANK WORLD RDZV_FILE OUT_FILE

Saves {scenario: results} (see tests/_ranks.py for the protocol).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from _ranks import worker_main
from torch import nn

from ampatch.compat import parallel


def _flat_calls(rank: int, world: int) -> dict[str, Any]:
    tensors = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 10.0 * (rank + 1), dtype=torch.float16),
               torch.full((4,), float(rank + 1), dtype=torch.float64), torch.full((5,), 100.0 * (rank + 1))]
    order = list(parallel.split_by_type(tensors))
    parallel.flat_dist_call(tensors, dist.all_reduce)  # summed, then divided by the world size
    averaged = [t.clone() for t in tensors]
    parallel.flat_dist_call(tensors, dist.broadcast, (1,))
    return {"order": order, "averaged": averaged, "broadcast": [t.clone() for t in tensors],
            "halves": [[t.dtype for t in b] for b in parallel.split_half_float_double(tensors)]}


def _reducer(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(rank)  # different weights per rank: the Reducer broadcasts rank 0's
    model = nn.Linear(3, 2)
    reducer = parallel.Reducer(model)
    weights = model.weight.detach().clone()
    model(torch.full((1, 3), float(rank + 1))).sum().backward()
    reducer.reduce()
    grads = [torch.full((2,), float(rank))]
    parallel.Reducer([grads]).reduce()
    return {"weight": weights, "weight_grad": model.weight.grad.clone(), "list_grad": grads[0]}


def _ddp(rank: int, world: int, grad: float, **kw: Any) -> float:
    """The all-reduced gradient of one float16 weight whose local gradient is `grad` on every rank."""
    model = nn.Linear(1, 1, bias=False).half()
    with torch.no_grad():
        model.weight.fill_(1.0)
    ddp = parallel.DistributedDataParallel(model, **kw)
    (ddp(torch.ones(1, 1, dtype=torch.float16)) * grad).sum().backward()
    return model.weight.grad.item()


TINY = 2.0 ** -24  # float16's smallest subnormal: half of it rounds to 0


def run_all(rank: int, world: int, extra: Sequence[str]) -> dict[str, Any]:
    return {
        "flat": _flat_calls(rank, world),
        "reducer": _reducer(rank, world),
        "ddp_tiny": _ddp(rank, world, TINY),  # torch divides each by 2 first: 2**-25 underflows
        "ddp_tiny_fp32": _ddp(rank, world, TINY, allreduce_always_fp32=True),  # sum, mean in FP32
        "ddp_predivide": _ddp(rank, world, 2 * TINY),
        "ddp_predivide4": _ddp(rank, world, 2 * TINY, gradient_predivide_factor=4.0),  # 2**-25: underflows
        "ddp_mean": _ddp(rank, world, 3.0),
        "ddp_sum": _ddp(rank, world, 3.0, gradient_average=False),
    }


if __name__ == "__main__":
    worker_main(sys.argv, run_all)
