"""Data-parallel training with DistributedDataParallel: `initialize` first, then wrap.

Every rank trains on its own shard of the data; DDP averages the gradients, and ampatch
all-reduces the overflow flag so that all ranks skip the same steps and keep the same loss
scale. `--accum N` accumulates N micro-batches per step, all but the last under `no_sync()`.
Runs on CPU (gloo) or one GPU per rank (nccl):

    torchrun --nproc_per_node 2 examples/distributed.py --opt-level O2 --steps 20
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ampatch as amp

HALF_DTYPES = {"auto": None, "float16": torch.float16, "bfloat16": torch.bfloat16}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--half-dtype", default="auto", choices=sorted(HALF_DTYPES),
                        help="auto: float16 on CUDA, bfloat16 on CPU")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64, help="per rank and step")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        parser.error("launch with torchrun, e.g. `torchrun --nproc_per_node 2 examples/distributed.py`")

    if torch.cuda.is_available():
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same toy data everywhere; each rank takes its own shard
    x = torch.randn(4096, 32)
    y = (x[:, :4].sum(1) > 0).long()
    x, y = x[rank::world].to(device), y[rank::world].to(device)
    torch.manual_seed(1 + rank)  # ranks may start from different weights: DDP broadcasts rank 0's

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      half_dtype=HALF_DTYPES[args.half_dtype], verbosity=0)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # after initialize

    micro = args.batch // args.accum
    for step in range(args.steps):
        start = (step * args.batch) % (len(x) - args.batch + 1)
        optimizer.zero_grad()
        total = 0.0
        for i in range(args.accum):
            xb = x[start + i * micro:start + (i + 1) * micro]
            yb = y[start + i * micro:start + (i + 1) * micro]
            last = i == args.accum - 1
            with contextlib.nullcontext() if last else ddp.no_sync():  # all-reduce once, on the last micro-batch
                loss = nn.functional.cross_entropy(ddp(xb), yb) / args.accum
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
            total += loss.item()
        optimizer.step()  # skipped on every rank if any rank's grads overflowed
        if step % 5 == 0 or step == args.steps - 1:
            print(f"rank {rank}  step {step:3d}  loss {total:.4f}  loss scale {amp.loss_scale():g}", flush=True)

    r = amp.report()
    checksum = sum(p.detach().double().sum().item() for p in amp.master_params(optimizer))
    print(f"rank {rank}  final loss {total:.4f}  ({r.opt_level}, half dtype {r.half_dtype}, "
          f"{len(r.skipped_steps)} skipped steps, params checksum {checksum:.10g})", flush=True)
    dist.destroy_process_group()
    return total


_finished = False


def _leave() -> None:
    """The last exit handler (registered first): gloo can abort during interpreter teardown after
    a clean destroy_process_group() ("terminate called without an active exception"); once the
    other handlers ran (ampatch's report under `ampatch compare`), a finished run leaves now."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _finished:
        os._exit(0)


if __name__ == "__main__":
    atexit.register(_leave)
    main()
    _finished = True
