"""Gradient accumulation: several micro-batches per optimizer step.

Divide each micro-batch loss by the number of micro-batches and back-propagate each one
through `scale_loss`; ampatch adds the unscaled grads up correctly even if the loss scale
changes between them. With `--delay-unscale`, all but the last micro-batch pass
`delay_unscale=True`: the grads stay scaled and are unscaled once, by the last `scale_loss`
(less work per micro-batch; the scale cannot change in between, as no step happens).

    python examples/accumulation.py --accum 4 --delay-unscale
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import ampatch as amp


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--delay-unscale", action="store_true")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(512, 32, device=device)
    y = (x[:, :4].sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

    for step in range(args.steps):
        optimizer.zero_grad()
        total = 0.0
        for i, (xb, yb) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum))):
            loss = nn.functional.cross_entropy(model(xb), yb) / args.accum
            last = i == args.accum - 1
            with amp.scale_loss(loss, optimizer, delay_unscale=args.delay_unscale and not last) as scaled_loss:
                scaled_loss.backward()
            total += loss.item()
        optimizer.step()  # once per `accum` micro-batches
        if step % 10 == 0:
            print(f"step {step:3d}  loss {total:.4f}")

    mode = "delay_unscale" if args.delay_unscale else "unscale each"
    print(f"final loss {total:.4f}  ({args.accum} micro-batches per step, {mode})")
    return total


if __name__ == "__main__":
    main()
