"""Checkpoint and resume: save model, optimizer and `amp.state_dict()`; after a crash,
load them and continue where the run stopped (bit-for-bit: each step's batch depends only
on the step number, and under O2/O5 the optimizer's state dict carries the FP32 masters).

    python examples/checkpoint.py --steps 40 --save ckpt.pt --kill-at 25   # dies at step 25
    python examples/checkpoint.py --steps 40 --save ckpt.pt --resume ckpt.pt
    python examples/checkpoint.py --steps 40                               # same final loss
"""
from __future__ import annotations

import argparse
import os

import torch
from torch import nn

import ampatch as amp


def batch(step: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(128, 32, generator=g)
    return x.to(device), (x[:, :4].sum(1) > 0).long().to(device)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=40, help="total steps, counting those before a resume")
    parser.add_argument("--save", metavar="PATH", help="write a checkpoint here after every step")
    parser.add_argument("--resume", metavar="PATH", help="continue from this checkpoint")
    parser.add_argument("--kill-at", type=int, metavar="STEP", help="simulate a crash: die at this step")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

    start = 0
    if args.resume:  # after initialize, like every state the session owns
        ckpt = torch.load(args.resume, map_location=device, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        amp.load_state_dict(ckpt["amp"])
        start = ckpt["step"]
        print(f"resumed from {args.resume} at step {start}")

    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        if step == args.kill_at:
            print(f"simulated crash at step {step}", flush=True)
            os._exit(1)  # no cleanup, no atexit: like a killed process
        x, y = batch(step, device)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if args.save:
            ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "amp": amp.state_dict(), "step": step + 1}
            torch.save(ckpt, args.save + ".tmp")
            os.replace(args.save + ".tmp", args.save)  # a crash mid-save keeps the old checkpoint

    print(f"final loss {loss.item():.8f} after {args.steps} steps ({args.opt_level})")
    return loss.item()


if __name__ == "__main__":
    main()
