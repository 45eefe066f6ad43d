"""A model with one layer that tensorwise FP8 ruins, for `ampatch diagnose --fp8` to find.

A classifier of raw readings whose scale spans twelve orders of magnitude from one sample to
the next (the class depends on the direction of a reading, not on its size). The first layer,
`embed`, sees them raw; `norm` then scales each sample to unit length, so every sample counts
the same after it. Tensorwise FP8 gives `embed`'s input one scale for the whole batch: e4m3
holds about five orders of magnitude below its largest value, so the smaller half of the
samples flush to zero and the model never learns them. The other layers see unit-length
samples and are as happy in FP8 as in bfloat16.

    python examples/fp8_outliers.py --opt-level O5                  # bfloat16: learns like O0
    AMPATCH_FP8=tensorwise python examples/fp8_outliers.py --opt-level O5   # stalls halfway

Find the layer and verify the fix in one command:

    ampatch diagnose --fp8 --opt-level O5 -- python examples/fp8_outliers.py

It names `embed` (most of its input flushes to zero in FP8) and reruns with it left out of
FP8 (`fp8_modules`, from outside `AMPATCH_FP8_MODULES`), which trains like O0.
"""
from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import torch
from torch import nn

import ampatch as amp

log = logging.getLogger("fp8-outliers-example")
DECADES = 12.0  # the samples' scales span 10**-DECADES to 1


class UnitLength(nn.Module):
    """Each sample scaled to unit length (a zero sample stays zero)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(h, dim=-1, eps=1e-30)


class Classifier(nn.Module):
    def __init__(self, features: int = 64, d: int = 128, classes: int = 16, hidden: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d, bias=False)
        self.norm = UnitLength()
        self.hidden = nn.ModuleList(nn.Linear(d, d) for _ in range(hidden))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x)) * 4.0
        for layer in self.hidden:
            h = h + torch.relu(layer(h))
        return self.head(h)


def batches(steps: int, seed: int, batch: int = 256, features: int = 64, classes: int = 16) -> list:
    """Readings of random direction and a scale drawn from 10**-DECADES to 1; the class is the
    direction's nearest of `classes` fixed directions."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(features, classes, generator=gen)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, features, generator=gen)
        y = (x @ directions).argmax(dim=-1)
        scale = 10.0 ** (-DECADES * torch.rand(batch, 1, generator=gen))
        out.append((x * scale, y))
    return out


def main(argv: Sequence[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--opt-level", default="O5")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    loss = torch.tensor(float("nan"))
    for step, (x, y) in enumerate(batches(args.steps, args.seed)):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            log.info("step %d loss %.4f", step, loss.item())
    print(f"final loss {loss.item():.4f}")
    return loss.item()


if __name__ == "__main__":
    main()
