"""A model that goes NaN in float16, for `ampatch diagnose` to find and fix.

A small attention classifier on raw (unnormalised) sensor features. Its hand-written
attention forgets the 1/sqrt(d) scaling of q @ k^T: in FP32 and bfloat16 the scores are
large but finite; float16 tops out at 65504, so under O1 with float16 they overflow to inf
and the softmax turns them into NaN. Trains fine at O0 and with bfloat16:

    python examples/diagnose.py --opt-level O1                      # bfloat16 on CPU: fine
    AMPATCH_HALF_DTYPE=float16 python examples/diagnose.py          # loss is nan

Find the module and verify the fix in one command:

    ampatch diagnose --half-dtype float16 -- python examples/diagnose.py

It names `encoder.attn.scores` and reruns with it kept in FP32 (`keep_fp32`), which trains
like O0. The fix, without editing this script: `ampatch run --half-dtype float16 --keep-fp32
encoder.attn.scores -- python examples/diagnose.py`.
"""
from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import ampatch as amp

log = logging.getLogger("diagnose-example")


class Scores(nn.Module):
    """Attention logits q @ k^T (the 1/sqrt(d) scaling forgotten)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-2, -1)


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.scores = Scores()
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = torch.softmax(self.scores(self.q(x), self.k(x)), dim=-1)
        return x + self.out(weights @ self.v(x))


class Encoder(nn.Module):
    def __init__(self, features: int, d: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.attn = Attention(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.embed(x))


class Classifier(nn.Module):
    def __init__(self, features: int = 16, d: int = 64, classes: int = 4) -> None:
        super().__init__()
        self.encoder = Encoder(features, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(x)).mean(dim=1))


def batches(steps: int, seed: int, batch: int = 16, seq: int = 24, features: int = 16) -> list:
    """Raw sensor windows (readings in the hundreds) and a class that depends on them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, seq, features, generator=gen) * 120.0
        y = (x[:, :, :4].mean(dim=1).argmax(dim=-1))
        out.append((x, y))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--opt-level", default="O1")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    for step, (x, y) in enumerate(batches(args.steps, args.seed)):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        if step % 10 == 0 or step == args.steps - 1:
            log.info("step %d loss %.4f", step, loss.item())


if __name__ == "__main__":
    main()
