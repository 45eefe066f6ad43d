"""One rank of the two-process FP8 runs behind tests/session/test_fp8_distributed.py.

    python tests/_fp8_worker.py RANK WORLD RDZV_FILE OUT_FILE

The protocol of tests/_ranks.py: a gloo group, every scenario below in turn, a dict
{scenario: results} saved with `torch.save` ({"error": traceback} for a scenario that
raised). The model is an MLP whose layers are all FP8-sized (dims multiples of 16); under
FSDP2 it is sharded the documented way (each layer, then the root; then the optimizer; then
`amp.initialize`), under DDP wrapped after `amp.initialize`.
"""
from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import ampatch as amp

STEPS = 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def batches(rank: int, n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    w = torch.randn(32, 16, generator=torch.Generator().manual_seed(7)) / 4
    return [(x, x @ w) for x in (torch.randn(32, 32, generator=gen) for _ in range(n))]


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list) -> list[float]:
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = F.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for k, v in model.state_dict().items()}


def sharded(rank: int, fp8: Any) -> dict[str, Any]:
    """FSDP2 at O5 with `fp8`: what the layers became, the loss, the scales torchao keeps."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    gathers = []
    own = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def spy(self: Any, mesh: Any) -> Any:  # what FSDP2 all-gathers for a wrapped weight (its signature checked)
        out = own(self, mesh)
        gathers.append(str(out[0][0].dtype))
        return out
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = spy
    try:
        return _sharded(rank, fp8, WeightWithDynamicFloat8CastTensor, gathers)
    finally:
        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = own


def _sharded(rank: int, fp8: Any, wrapper: type, gathers: list[str]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    for layer in (model.fc1, model.fc2, model.head):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    keys = list(model.state_dict())
    model, opt = amp.initialize(model, opt, opt_level="O5", fp8=fp8, verbosity=0)
    res: dict[str, Any] = {"classes": [type(model.fc1).__name__, type(model.head).__name__],
                           "fp8_gathered": isinstance(model.fc2.weight._local_tensor, wrapper),
                           "same_params": all(a is b for a, b in zip(params, model.parameters())),
                           "same_keys": list(model.state_dict()) == keys}
    res["losses"] = train(model, opt, batches(rank))
    res["gathered_dtypes"] = sorted(set(gathers))
    res["scale_precomputed"] = getattr(model.fc2.weight._local_tensor, "_precomputed_scale", None) is not None
    res["report"] = amp.report().fp8_label
    trained = full(model)
    amp.deinitialize()
    res["restored"] = [type(model.fc1).__name__, type(model.fc2.weight._local_tensor).__name__]
    res["same_after"] = all(torch.equal(trained[k], v) for k, v in full(model).items())
    opt.zero_grad()
    F.mse_loss(model(batches(rank, 1)[0][0]), batches(rank, 1)[0][1]).backward()  # plain FSDP2 again
    opt.step()
    res["plain_step"] = True
    return res


def replicated(rank: int) -> dict[str, Any]:
    """DDP at O5 with fp8 (wrapped after initialize): ranks end with the same weights."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.initialize(model, opt, opt_level="O5", fp8="rowwise", master_weights="kahan", verbosity=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    losses = train(ddp, opt, batches(rank))
    weights = full(model)
    amp.deinitialize()
    return {"losses": losses, "weights": weights, "classes": type(model.fc1).__name__}


SCENARIOS: list[tuple[str, Callable[..., Any], tuple]] = [
    ("fsdp/tensorwise", sharded, (True,)), ("fsdp/rowwise", sharded, ("rowwise",)), ("ddp", replicated, ()),
]


def run_all(rank: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, fn, args in SCENARIOS:
        try:
            results[name] = fn(rank, *args)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            amp.deinitialize()
    return results


if __name__ == "__main__":
    from _ranks import worker_main

    worker_main(sys.argv, lambda rank, world, args: run_all(rank))
