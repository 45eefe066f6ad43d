"""Default workload: a tiny character-level transformer LM on the shipped corpus.

Pre-norm encoder layers with a causal mask, AdamW. The ``large`` size (two 256-wide layers,
sequence 64, batch 16) is wide enough that bfloat16 GEMMs pay off on a CPU with
AVX512-BF16; the smaller ones let a CPU that emulates bfloat16 train a few dozen steps per
level in ``ampatch compare``'s budget, ``huge`` is for GPUs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ampatch import workloads
from ampatch.workloads import _common

DEFAULT_STEPS = workloads.DEFAULT_STEPS["lm"]
LR = 1e-3


@dataclass(frozen=True)
class Dims:
    """The transformer's dimensions and the batch, for one size."""

    d_model: int
    heads: int
    ff: int
    layers: int
    seq: int
    batch: int = 16

    def describe(self) -> str:
        return f"d_model {self.d_model}, seq {self.seq}" + (f", {self.layers} layers" if self.layers != 2 else "")


SIZES = {"tiny": Dims(64, 2, 256, 2, 32), "small": Dims(128, 4, 512, 2, 32), "medium": Dims(128, 4, 512, 2, 64),
         "large": Dims(256, 4, 1024, 2, 64), "huge": Dims(512, 8, 2048, 4, 128)}


class CharTransformer(nn.Module):
    """Token + position embeddings, causal encoder layers, a linear head."""

    mask: torch.Tensor  # the causal mask, a non-persistent buffer

    def __init__(self, vocab: int, dims: Dims = SIZES[workloads.DEFAULT_SIZE]) -> None:
        super().__init__()
        d = dims.d_model
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(dims.seq, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, dims.heads, dims.ff, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(dims.layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        # Boolean mask: converted to the query's dtype inside attention, so it suits any level.
        self.register_buffer("mask", torch.ones(dims.seq, dims.seq, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
        for layer in self.layers:
            x = layer(x, src_mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


def build(args: argparse.Namespace):
    """Model, optimizer, batches and loss for ``args``."""
    dims = SIZES[args.size]
    ids, vocab = _common.encode_corpus()
    model = CharTransformer(vocab, dims).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    batches = _common.text_batches(ids, args.steps, dims.batch, dims.seq, args.seed + 1)
    return model, optimizer, batches, _common.lm_loss


def main(argv: Sequence[str] | None = None) -> int:
    """Train the LM for ``--steps`` steps at ``--opt-level``; exit code 0."""
    return _common.run("lm", argv, DEFAULT_STEPS, build)


if __name__ == "__main__":
    raise SystemExit(main())
