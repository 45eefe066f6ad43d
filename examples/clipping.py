"""Gradient clipping: clip the params the optimizer steps, `amp.master_params(optimizer)`.

Inside `scale_loss` the grads are scaled; after it they are unscaled (into the FP32 master
weights under O2/O5), so clip between the `with` block and `optimizer.step()`.

    python examples/clipping.py --opt-level O2 --max-norm 0.5
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import ampatch as amp


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--max-norm", type=float, default=1.0)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(512, 32, device=device)
    y = x @ torch.randn(32, 1, device=device)  # targets of std ~6: large early grads
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

    for step in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        # Unscaled grads now; the norm is inf/nan only on an overflow, and then step() is skipped.
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), args.max_norm)
        optimizer.step()
        if step % 25 == 0:
            print(f"step {step:3d}  loss {loss.item():9.4f}  grad norm before clipping {norm.item():9.3f}")

    print(f"final loss {loss.item():.4f}  (grads clipped to norm {args.max_norm})")
    return loss.item()


if __name__ == "__main__":
    main()
