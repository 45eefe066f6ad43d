"""Sharded training with FSDP2 (`fully_shard`): shard, build the optimizer, then initialize.

Every rank holds a shard of each parameter and of the optimizer state; FSDP2 all-gathers a
block's weights for its forward and backward and reduce-scatters its gradients. Under O2/O5
the sharded FP32 parameters are the masters, the block computes in half, and gradients are
reduced in FP32 (FSDP2's own mixed precision, set by the level); ampatch keeps the loss
scaling and skips a step on every rank when any rank's gradients overflowed. `--accum N`
accumulates N micro-batches per step, all but the last with gradient sync off; gradients
are clipped through `amp.master_params`.
Runs on CPU (gloo) or one GPU per rank (nccl):

    torchrun --nproc_per_node 2 examples/fsdp.py --opt-level O2 --steps 20
    ampatch compare -- torchrun --nproc_per_node 2 examples/fsdp.py
"""
from __future__ import annotations

import argparse
import atexit
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import ampatch as amp

HALF_DTYPES = {"auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Model(nn.Module):
    """An input layer, residual blocks (one fully_shard unit each), a classifier head."""

    def __init__(self, width: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--half-dtype", default="auto", choices=sorted(HALF_DTYPES),
                        help="auto: float16 on CUDA, bfloat16 on CPU")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="per rank and step")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    args = parser.parse_args(argv)
    own_group = not dist.is_initialized()  # a test may run this inside its own process group
    if own_group and "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. `torchrun --nproc_per_node 2 examples/fsdp.py`")

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same toy data and initial weights everywhere; each rank takes its own data shard
    x = torch.randn(4096, 32)
    y = (x[:, :4].sum(1) > 0).long()
    x, y = x[rank::world].to(device), y[rank::world].to(device)
    model = Model().to(device)

    # 1. shard: each block is a unit (its weights are all-gathered together), then the root
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    # 2. the optimizer, over the sharded parameters
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # 3. then ampatch
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      half_dtype=HALF_DTYPES[args.half_dtype], verbosity=0)

    micro = args.batch // args.accum
    total = 0.0
    for step in range(args.steps):
        start = (step * args.batch) % (len(x) - args.batch + 1)
        optimizer.zero_grad()
        total = 0.0
        for i in range(args.accum):
            xb = x[start + i * micro:start + (i + 1) * micro]
            yb = y[start + i * micro:start + (i + 1) * micro]
            model.set_requires_gradient_sync(i == args.accum - 1)  # reduce once, on the last micro-batch
            loss = nn.functional.cross_entropy(model(xb), yb) / args.accum
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            total += loss.item()
        if args.clip > 0:  # the sharded params the optimizer steps (FP32 masters at O2/O5); the norm spans all ranks
            torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.clip)
        optimizer.step()  # skipped on every rank if any rank's gradients overflowed
        if step % 5 == 0 or step == args.steps - 1:
            print(f"rank {rank}  step {step:3d}  loss {total:.4f}  loss scale {amp.loss_scale():g}", flush=True)

    r = amp.report()
    # the full parameters, gathered from every rank's shard: the same on every rank
    checksum = sum(p.full_tensor().double().sum().item() for p in amp.master_params(optimizer))
    print(f"rank {rank}  final loss {total:.4f}  ({r.opt_level}, half dtype {r.half_dtype}, "
          f"{len(r.skipped_steps)} skipped steps, params checksum {checksum:.10g})", flush=True)
    if own_group:
        dist.destroy_process_group()
    return total


_finished = False


def _leave() -> None:
    """The last exit handler (registered first): gloo can abort during interpreter teardown after a
    clean destroy_process_group() ("terminate called without an active exception"); once the
    other handlers ran (ampatch's report under `ampatch compare`), a finished run leaves now."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _finished:
        os._exit(0)


if __name__ == "__main__":
    atexit.register(_leave)
    main()
    _finished = True
