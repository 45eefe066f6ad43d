"""Workload: a character-level LSTM language model on the shipped corpus, Adam.

Exercises ampatch's RNN support (whole ``nn.LSTM`` modules run in half under O1).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ampatch import workloads
from ampatch.workloads import _common

DEFAULT_STEPS = workloads.DEFAULT_STEPS["lstm"]
LR = 3e-3


@dataclass(frozen=True)
class Dims:
    """The LSTM's dimensions and the batch, for one size."""

    embed: int
    hidden: int
    layers: int
    seq: int
    batch: int = 16

    def describe(self) -> str:
        return f"hidden {self.hidden}, {self.layers} layer{'s' if self.layers != 1 else ''}, seq {self.seq}"


SIZES = {"tiny": Dims(32, 64, 1, 32), "small": Dims(64, 128, 2, 32), "medium": Dims(64, 128, 2, 64),
         "large": Dims(64, 256, 2, 64), "huge": Dims(128, 512, 2, 128, 32)}


class CharLSTM(nn.Module):
    """Embedding, a stacked LSTM, a linear head."""

    def __init__(self, vocab: int, dims: Dims = SIZES[workloads.DEFAULT_SIZE]) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dims.embed)
        self.lstm = nn.LSTM(dims.embed, dims.hidden, num_layers=dims.layers, batch_first=True)
        self.head = nn.Linear(dims.hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


def build(args: argparse.Namespace):
    """Model, optimizer, batches and loss for ``args``."""
    dims = SIZES[args.size]
    ids, vocab = _common.encode_corpus()
    model = CharLSTM(vocab, dims).to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    batches = _common.text_batches(ids, args.steps, dims.batch, dims.seq, args.seed + 1)
    return model, optimizer, batches, _common.lm_loss


def main(argv: Sequence[str] | None = None) -> int:
    """Train the LSTM for ``--steps`` steps at ``--opt-level``; exit code 0."""
    return _common.run("lstm", argv, DEFAULT_STEPS, build)


if __name__ == "__main__":
    raise SystemExit(main())
