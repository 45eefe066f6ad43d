#!/usr/bin/env python3
"""A fine-tune for `ampatch tune --objective memory` (issue 46): one where int8 optimizer state
holds, and, with `--planted`, one where it cannot.

A linear model of 256 inputs learns a teacher's outputs (noisy targets), AdamW, from a
perturbed start. With `--planted`, input 0 is always zero (a padding feature) and the loss
carries a penalty on the model's weights for it, whose gradient is a million times the
others': harmless to what the model predicts (the feature is zero), and in FP32 or bfloat16
state each element's moments are its own. In int8 state the weights of a row share a block
of 256 with that weight, whose moments are about 1e8 (first) and 1e16 (second) times
theirs, far more than a block holds (about 2e-6 and 1e-10 of its largest): theirs sit at
the bottom of the block's range (the first moment at zero), the row's weights stop, and
the fine-tune stalls (only the biases learn) where FP32 state's goes on.

    ampatch tune --objective memory --levels O5 --steps 60 -- python scripts/optimizer_states_case.py
    ampatch tune --objective memory --levels O5 --steps 60 -- python scripts/optimizer_states_case.py --planted
"""
from __future__ import annotations

import argparse

import torch
from torch import nn

import ampatch as amp

IN, OUT, BATCH, PENALTY = 256, 64, 64, 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--planted", action="store_true", help="the case int8 state cannot hold")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=3e-3)
    a = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    teacher = nn.Linear(IN, OUT)
    model = nn.Linear(IN, OUT)
    with torch.no_grad():
        model.weight.copy_(teacher.weight + 0.05 * torch.randn(OUT, IN))
        model.bias.copy_(teacher.bias)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O5")
    gen = torch.Generator().manual_seed(1)
    for step in range(a.steps):
        x = torch.randn(BATCH, IN, generator=gen)
        if a.planted:
            x[:, 0] = 0.0
        with torch.no_grad():
            y = teacher(x) + 0.1 * torch.randn(BATCH, OUT, generator=gen)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x).float(), y)
        if a.planted:  # a gradient of PENALTY on each weight of input 0; the loss's value unchanged (w - w is 0)
            w = model.weight[:, 0].float()
            loss = loss + PENALTY * (w - w.detach()).sum()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.5f}", flush=True)


if __name__ == "__main__":
    main()
