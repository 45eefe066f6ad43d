"""A model that one module ruins in bfloat16, for `ampatch tune` to repair.

A small classifier whose hand-written normalisation computes the variance as
E[x^2] - E[x]^2, its sums as matrix products. Its inputs have a large mean (30) and a small
spread (about 1), so x^2 is about 900, where bfloat16 keeps a step of 4: the difference of
two such numbers is noise, and so is the normalised output. FP32 keeps it whole. Every half level trains off O0's curve
(or to NaN), until `norm` runs in FP32:

    python examples/tune.py                       # O1 bfloat16 (the script's own level)
    ampatch tune -- python examples/tune.py       # finds keep_fp32=['norm'] and writes the policy
    ampatch run --policy ampatch-policy.json -- python examples/tune.py

The script trains `--steps` steps (``AMPATCH_MAX_STEPS`` stops it earlier, as `tune` does).
"""
from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import ampatch as amp

log = logging.getLogger("tune-example")


class NaiveNorm(nn.Module):
    """Normalisation over the last dimension with the one-pass variance E[x^2] - E[x]^2, its
    sums written as matrix products (which O1 runs in the half dtype)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))
        self.register_buffer("avg", torch.full((d, 1), 1.0 / d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x @ self.avg                                   # E[x]
        var = (x * x) @ self.avg - mean * mean                # E[x^2] - E[x]^2
        return (x - mean) / (var.clamp_min(1e-3) + 1e-5).sqrt() * self.scale


class Net(nn.Module):
    def __init__(self, d_in: int = 32, d: int = 512, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        nn.init.constant_(self.embed.bias, 30.0)   # features centred far from 0
        self.norm = NaiveNorm(d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.norm(self.embed(x))))


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--opt-level", default="O1")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = Net()
    teacher = nn.Linear(32, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    gen = torch.Generator().manual_seed(args.seed + 1)
    for step in range(args.steps):
        x = torch.randn(512, 32, generator=gen)
        with torch.no_grad(), amp.disable_casts():  # the labels: the same at every level
            y = teacher(x).argmax(-1)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        if step % 50 == 0:
            log.info("step %d loss %.4f", step, loss.item())
    r = amp.report()
    print(f"final loss {loss.item():.4f}  ({r.opt_level}, half dtype {r.half_dtype}, "
          f"kept in FP32: {r.keep_fp32 or 'none'})")
    return loss.item()


if __name__ == "__main__":
    main()
