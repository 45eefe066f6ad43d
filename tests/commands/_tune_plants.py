"""Training scripts for the tune/compare/diagnose tests of issue 45, run as `ampatch` runs a
user's script (python _tune_plants.py CASE [--steps N] [--lr LR] [--seed S]):

- ``fullbatch``: one fixed batch (no batch noise: the run is deterministic on a CPU), AdamW at
  a learning rate (default 1e-9) whose updates are below FP32's own resolution for most
  weights: the loss moves by a few float32 ulps, which no loss can witness;
- ``inner``: a classifier that computes its own loss inside its forward (as Transformers models
  do), so at O2/O3/O5 the loss itself is a half number; small learning rate, its progress
  over a short run a few bfloat16 ulps of the loss: the paired differences from O0 are too
  noisy for the default tolerance until the run is longer;
- ``cnn``: a small CNN with batch norm, AdamW (eps 1e-8) and OneCycleLR, the scheduler stepped
  only after steps that were not skipped (`amp.last_step_skipped`): float16 at O3 rounds eps
  to 0 and the optimizer's own step makes weights NaN.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp


class Inner(nn.Module):
    """A classifier that returns its own loss (computed in the dtype its forward runs in)."""

    def __init__(self, d: int = 64, classes: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 128), nn.GELU(), nn.Linear(128, classes))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        return F.cross_entropy(logits, y)


def step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    """One optimizer step of the amp recipe."""
    opt.zero_grad()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def fullbatch(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr or 1e-9)
    model, opt = amp.initialize(model, opt, opt_level=args.opt_level)
    x = torch.randn(256, 32)
    y = torch.randn(256, 1)
    for _ in range(args.steps):
        step(opt, F.mse_loss(model(x).float(), y) + 1.0)


def inner(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    model = Inner()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr or 3e-4)
    model, opt = amp.initialize(model, opt, opt_level=args.opt_level)
    gen = torch.Generator().manual_seed(args.seed + 1)
    centres = torch.randn(8, 64, generator=gen)
    for _ in range(args.steps):
        y = torch.randint(0, 8, (256,), generator=gen)
        step(opt, model(0.3 * centres[y] + torch.randn(256, 64, generator=gen), y))


def cnn(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    lr = args.lr or 3e-3
    opt = torch.optim.AdamW(model.parameters(), lr=lr, eps=1e-8)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(args.steps, 2))
    model, opt = amp.initialize(model, opt, opt_level=args.opt_level)
    gen = torch.Generator().manual_seed(args.seed + 1)
    protos = torch.randn(10, 3, 16, 16, generator=gen)
    for _ in range(args.steps):
        y = torch.randint(0, 10, (64,), generator=gen)
        step(opt, F.cross_entropy(model(protos[y] + 0.8 * torch.randn(64, 3, 16, 16, generator=gen)), y))
        if not amp.last_step_skipped(opt):   # a skipped step does not advance the schedule
            sched.step()


CASES = {"fullbatch": fullbatch, "inner": inner, "cnn": cnn}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("case", choices=sorted(CASES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--opt-level", default="O0")
    args = p.parse_args()
    torch.set_num_threads(1)
    CASES[args.case](args)


if __name__ == "__main__":
    main()
