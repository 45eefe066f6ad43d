"""Workload: a character-level LSTM language model on the shipped corpus, Adam.

Exercises ampatch's RNN support (whole ``nn.LSTM`` modules run in half under O1).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch import nn

from ampatch import workloads
from ampatch.workloads import _common

EMBED, HIDDEN, LAYERS, SEQ, BATCH = 64, 256, 2, 64, 16
DEFAULT_STEPS = workloads.DEFAULT_STEPS["lstm"]


class CharLSTM(nn.Module):
    """Embedding, a two-layer LSTM, a linear head."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, EMBED)
        self.lstm = nn.LSTM(EMBED, HIDDEN, num_layers=LAYERS, batch_first=True)
        self.head = nn.Linear(HIDDEN, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(ids))
        return self.head(out)


def build(args: argparse.Namespace):
    """Model, optimizer, batches and loss for ``args``."""
    ids, vocab = _common.encode_corpus()
    model = CharLSTM(vocab).to(args.device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = _common.text_batches(ids, args.steps, BATCH, SEQ, args.seed + 1)
    return model, optimizer, batches, _common.lm_loss


def main(argv: Sequence[str] | None = None) -> int:
    """Train the LSTM for ``--steps`` steps at ``--opt-level``; exit code 0."""
    return _common.run("lstm", argv, DEFAULT_STEPS, build)


if __name__ == "__main__":
    raise SystemExit(main())
