"""The three-line integration: `initialize`, `scale_loss`, `step`.

Train a small classifier with ampatch; change `--opt-level` to compare precision modes
(O0 FP32, O1 patched ops, O2 half model + FP32 masters, O3 pure half, O4/O5 bfloat16).

    python examples/basic.py --opt-level O2 --steps 100
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
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(512, 32, device=device)
    y = (x[:, :4].sum(1) > 0).long()  # a toy task the model can learn
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)  # 1
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:                        # 2
            scaled_loss.backward()
        optimizer.step()                                 # 3: skipped if the grads overflowed
        if step % 25 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}  loss scale {amp.loss_scale():g}")

    r = amp.report()
    print(f"final loss {loss.item():.4f}  ({r.opt_level}, half dtype {r.half_dtype}, "
          f"{len(r.skipped_steps)} skipped steps)")
    return loss.item()


if __name__ == "__main__":
    main()
