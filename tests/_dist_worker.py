"""One rank of the two-process run behind tests/session/test_distributed.py.

    python tests/_dist_worker.py RANK WORLD RDZV_FILE OUT_FILE

Joins a gloo group through `file://RDZV_FILE`, runs every scenario below in turn (one
process pair for the whole test file: starting torch costs seconds), saves a dict
{scenario name: results} to OUT_FILE with `torch.save`, then leaves with `os._exit` after
`destroy_process_group()` (gloo can abort during interpreter teardown, see DESIGN.md).
An exception is saved as {"error": traceback} and the exit status is 1.

Models are tiny: float16 matmul on CPU is slow.
"""
from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ampatch as amp

INJECT_STEP = 2   # the step whose grads get an inf on rank 1 only
INF_STEPS = 4
ACCUM_STEPS = 3
START_SCALE = 2.0 ** 10  # low enough that tiny float16 grads never overflow by themselves

# (name, opt level, half dtype)
CONFIGS = [("O1-fp16", "O1", torch.float16), ("O2-fp16", "O2", torch.float16), ("O2-bf16", "O2", torch.bfloat16)]


class Net(nn.Module):
    """Linear -> norm -> ReLU -> Linear. With batch norm, O2 has FP32 params (their own
    masters) next to half params with FP32 masters."""

    def __init__(self, norm: str = "batch") -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if norm == "batch" else nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.norm(self.fc1(x))))


def _setup(model: nn.Module, level: str, half: torch.dtype, lr: float = 0.05, **kw: Any):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=half, loss_scale="dynamic",
                                verbosity=0, **kw)
    amp.load_state_dict({"loss_scaler0": {"loss_scale": START_SCALE, "unskipped": 0}})
    return model, opt


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters (in the model's own dtypes) and what the optimizer steps (FP32 masters at O2).
    Buffers are left out: batch-norm running stats are per rank until DDP's next forward."""
    return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
            "masters": [p.detach().clone() for p in amp.master_params(opt)]}


def _batch(gen: torch.Generator, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 8, generator=gen), torch.randn(n, 4, generator=gen)


def inf_on_one_rank(rank: int, level: str, half: torch.dtype) -> dict[str, Any]:
    """DDP training where rank 1 alone sees an inf after the gradient all-reduce.

    Each rank starts from its own random weights (as an unseeded torchrun script does):
    DDP's broadcast from rank 0 must reach the FP32 masters too."""
    torch.manual_seed(100 + rank)
    model, opt = _setup(Net("batch"), level, half)
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    out: dict[str, Any] = {"steps": [], "scales": []}
    for step in range(INF_STEPS):
        x, y = _batch(gen)
        opt.zero_grad()
        loss = F.mse_loss(ddp(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()  # DDP all-reduces here
            if step == INJECT_STEP and rank == 1:
                with torch.no_grad():
                    model.fc1.weight.grad[0, 0] = float("inf")
        opt.step()
        out["steps"].append(_snapshot(model, opt))
        out["scales"].append(amp.loss_scale())
    out["skipped"] = list(amp.report().skipped_steps)
    out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    amp.deinitialize()
    return out


def no_sync_accumulation(rank: int, level: str, half: torch.dtype, delay_unscale: bool) -> dict[str, Any]:
    """The same training twice: two micro-batches (the first under `no_sync()`) versus the
    whole batch at once. Layer norm, not batch norm, so micro-batches see the same math."""
    out: dict[str, Any] = {}
    for mode in ("accumulated", "whole"):
        torch.manual_seed(7)
        model, opt = _setup(Net("layer"), level, half, lr=0.1)
        ddp = DDP(model)
        first = _snapshot(model, opt)
        gen = torch.Generator().manual_seed(2000 + rank)
        for i in range(ACCUM_STEPS):
            x, y = _batch(gen)
            opt.zero_grad()
            if mode == "whole":
                with amp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
                    scaled.backward()
            else:
                with ddp.no_sync():
                    loss = F.mse_loss(ddp(x[:4]), y[:4]) / 2
                    with amp.scale_loss(loss, opt, delay_unscale=delay_unscale) as scaled:
                        scaled.backward()
                loss = F.mse_loss(ddp(x[4:]), y[4:]) / 2
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
            if i == 0:  # ranks started alike: the masters must still be the exact FP32 weights
                out[f"{mode}_masters_before_step"] = [p.detach().clone() for p in amp.master_params(opt)]
            opt.step()
        out[mode] = {"first": first, "last": _snapshot(model, opt), "scale": amp.loss_scale(),
                     "skipped": list(amp.report().skipped_steps)}
        amp.deinitialize()
    return out


def exception_keeps_grads(rank: int, level: str, half: torch.dtype) -> dict[str, Any]:
    """Under torch.distributed, scale_loss scales the grads already there in place (so DDP's
    all-reduce sees them); an exception in the block must put them back unscaled."""
    torch.manual_seed(9)
    model, opt = _setup(Net("layer"), level, half)
    ddp = DDP(model)
    x, y = _batch(torch.Generator().manual_seed(4000 + rank))
    opt.zero_grad()
    with ddp.no_sync():
        with amp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
            scaled.backward()
    before = [p.grad.clone() for p in amp.master_params(opt)]
    raised = False
    try:
        with ddp.no_sync():
            with amp.scale_loss(F.mse_loss(ddp(x), y), opt):
                raise KeyError("in the scale_loss block")
    except KeyError:
        raised = True
    after = [None if p.grad is None else p.grad.clone() for p in amp.master_params(opt)]
    amp.deinitialize()
    return {"raised": raised, "before": before, "after": after}


def exception_after_backward(rank: int, level: str, half: torch.dtype) -> dict[str, Any]:
    """Blocks that raise after their backward, under `no_sync()` so no rank
    waits on a collective: a plain exception, then a KeyboardInterrupt from a backward hook
    (a partial backward), then an exception after an inf in the new grads. The grads must
    come out unscaled, and the inf must make the next step skip."""
    torch.manual_seed(9)
    model, opt = _setup(Net("layer"), level, half)
    ddp = DDP(model)
    x, y = _batch(torch.Generator().manual_seed(5000 + rank))

    def grads() -> list[torch.Tensor]:
        return [p.grad.clone() for p in amp.master_params(opt)]

    def interrupt(_grad: torch.Tensor) -> None:
        raise KeyboardInterrupt

    def hook_output(_module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        output.register_hook(interrupt)

    out: dict[str, Any] = {}
    opt.zero_grad()
    with ddp.no_sync():
        with amp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
            scaled.backward()
    out["one"] = grads()
    try:
        with ddp.no_sync():
            with amp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
                scaled.backward()
                raise KeyError("after the backward")
    except KeyError:
        pass
    out["two"] = grads()
    try:
        with ddp.no_sync():
            hook = model.fc1.register_forward_hook(hook_output)
            loss = F.mse_loss(ddp(x), y)
            hook.remove()
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
    except KeyboardInterrupt:
        pass
    out["three"] = grads()
    opt.zero_grad()
    try:
        with ddp.no_sync():
            with amp.scale_loss(F.mse_loss(ddp(x), y), opt) as scaled:
                scaled.backward()
                model.fc2.weight.grad.view(-1)[0] = float("inf")
                raise KeyError("after an inf")
    except KeyError:
        pass
    before = [p.detach().clone() for p in amp.master_params(opt)]
    opt.step()
    out["unchanged_after_inf"] = all(torch.equal(a, p) for a, p in zip(before, amp.master_params(opt)))
    out["skipped"] = list(amp.report().skipped_steps)
    amp.deinitialize()
    return out


LOWMEM_MODES = ("stochastic", "kahan")


def lowmem_ranks(rank: int, mode: str) -> dict[str, Any]:
    """master_weights="stochastic"/"kahan" under DDP. Each rank starts from its own
    weights and its own global seed (`manual_seed(100 + rank)`): DDP's broadcast makes the
    weights agree, and the first scale_loss must make the rounding seeds and step counts (stochastic)
    and the compensations (kahan) agree too, or the ranks drift apart. Rank 1 alone sees an
    inf at INJECT_STEP: both skip. Then two micro-batches, the first under `no_sync()`."""
    from ampatch.session.session import current
    torch.manual_seed(100 + rank)
    model, opt = _setup(Net("batch"), "O5", torch.bfloat16, lr=0.01, master_weights=mode)
    ddp = DDP(model)
    gen = torch.Generator().manual_seed(1000 + rank)
    masters = current().optimizers[0].masters
    out: dict[str, Any] = {"steps": []}
    for step in range(INF_STEPS + 2):
        x, y = _batch(gen)
        opt.zero_grad()
        if step >= INF_STEPS:  # accumulation: the first half without the all-reduce
            with ddp.no_sync():
                with amp.scale_loss(F.mse_loss(ddp(x[:4]), y[:4]) / 2, opt) as scaled:
                    scaled.backward()
            x, y = x[4:], y[4:]
        loss = F.mse_loss(ddp(x), y) / (2 if step >= INF_STEPS else 1)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
            if step == INJECT_STEP and rank == 1:
                with torch.no_grad():
                    model.fc1.weight.grad[0, 0] = float("inf")
        opt.step()
        snap = _snapshot(model, opt)
        snap["comp"] = [c.clone() for c in masters.comp.values()]
        if mode == "stochastic":  # kahan keeps each rank's own seed: it never draws from it
            snap["rounding"] = [masters.seed, masters.rounds]
        out["steps"].append(snap)
    out["skipped"] = list(amp.report().skipped_steps)
    out["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
    amp.deinitialize()
    return out


def initialize_after_ddp(rank: int) -> dict[str, Any]:
    """Wrapping first is the wrong order: initialize must refuse it."""
    model = Net("layer")
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    try:
        amp.initialize(ddp, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    except RuntimeError as e:
        return {"error": str(e), "dtype": str(model.fc1.weight.dtype)}
    finally:
        amp.deinitialize()
    return {"error": None}


def process_groups(rank: int, world: int) -> dict[str, Any]:
    """`initialize(process_group=...)`: the flag is reduced over that group, not the world.

    "pair": an explicit group of both ranks (DDP over it too) -> both skip.
    "single": each rank in its own group -> only the rank that saw the inf skips."""
    pair = dist.new_group(list(range(world)))
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group, in order
    out: dict[str, Any] = {}
    for kind, group in (("pair", pair), ("single", singles[rank])):
        torch.manual_seed(5)
        model, opt = _setup(Net("layer"), "O1", torch.float16, process_group=group)
        net = DDP(model, process_group=pair) if kind == "pair" else model
        gen = torch.Generator().manual_seed(3000 + rank)
        for step in range(3):
            x, y = _batch(gen)
            opt.zero_grad()
            with amp.scale_loss(F.mse_loss(net(x), y), opt) as scaled:
                scaled.backward()
                if step == 1 and rank == 1:
                    with torch.no_grad():
                        model.fc1.weight.grad[0, 0] = float("nan")
            opt.step()
        out[kind] = {"skipped": list(amp.report().skipped_steps), "scale": amp.loss_scale(),
                     "final": _snapshot(model, opt)}
        amp.deinitialize()
    return out


def run_all(rank: int, world: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, level, half in CONFIGS:
        results[f"inf/{name}"] = inf_on_one_rank(rank, level, half)
        for delay in (False, True):
            results[f"no_sync/{name}/delay_unscale={delay}"] = no_sync_accumulation(rank, level, half, delay)
        results[f"exception/{name}"] = exception_keeps_grads(rank, level, half)
        results[f"exception_after_backward/{name}"] = exception_after_backward(rank, level, half)
    for mode in LOWMEM_MODES:
        results[f"lowmem/{mode}"] = lowmem_ranks(rank, mode)
    results["initialize_after_ddp"] = initialize_after_ddp(rank)
    results["process_groups"] = process_groups(rank, world)
    return results


if __name__ == "__main__":
    from _ranks import worker_main

    worker_main(sys.argv, lambda rank, world, args: run_all(rank, world))
