"""Gradient penalty: a loss term made of the model's own gradients.

1. Take the grads of the *scaled* loss (`loss * amp.loss_scale()`) with
   `torch.autograd.grad(..., create_graph=True)`: small grads would underflow in float16.
2. Unscale them by dividing by `amp.loss_scale()` (not part of the graph: a plain number).
3. Add the penalty to the loss and run one backward through `amp.scale_loss`.
On an overflow the penalty is inf/NaN, its grads are too, and `optimizer.step()` is skipped.

    python examples/gradient_penalty.py --opt-level O2 --penalty 0.1
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import ampatch as amp


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--penalty", type=float, default=0.1, help="weight of the grad-norm penalty")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(512, 32, device=device)
    y = (x[:, :4].sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    params = [p for p in model.parameters() if p.requires_grad]  # the (half, under O2) model params

    for step in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        scale = amp.loss_scale()
        scaled_grads = torch.autograd.grad(loss.float() * scale, params, create_graph=True)   # 1
        grads = [g.float() / scale for g in scaled_grads]                                     # 2
        grad_norm_sq = sum(g.pow(2).sum() for g in grads)
        total = loss + args.penalty * grad_norm_sq                                            # 3
        with amp.scale_loss(total, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  grad norm^2 {grad_norm_sq.item():.4f}")

    print(f"final loss {loss.item():.4f}  grad norm^2 {grad_norm_sq.item():.4f}  (penalty {args.penalty})")
    return total.item()


if __name__ == "__main__":
    main()
