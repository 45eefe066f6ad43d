"""Default workload: a tiny character-level transformer LM on the shipped corpus.

Two 256-wide pre-norm encoder layers with a causal mask, sequence 64, batch 16, AdamW:
wide enough that bfloat16 GEMMs pay off on a CPU with AVX512-BF16, small enough that a
step takes a fraction of a second.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
from torch import nn

from ampatch import workloads
from ampatch.workloads import _common

D_MODEL, HEADS, FF, LAYERS, SEQ, BATCH = 256, 4, 1024, 2, 64, 16
DEFAULT_STEPS = workloads.DEFAULT_STEPS["lm"]


class CharTransformer(nn.Module):
    """Token + position embeddings, causal encoder layers, a linear head."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True,
                                       norm_first=True)
            for _ in range(LAYERS))
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, vocab)
        # Boolean mask: converted to the query's dtype inside attention, so it suits any level.
        self.register_buffer("mask", torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(n, device=ids.device))
        for layer in self.layers:
            x = layer(x, src_mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(x))


def build(args: argparse.Namespace):
    """Model, optimizer, batches and loss for ``args``."""
    ids, vocab = _common.encode_corpus()
    model = CharTransformer(vocab).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    batches = _common.text_batches(ids, args.steps, BATCH, SEQ, args.seed + 1)
    return model, optimizer, batches, _common.lm_loss


def main(argv: Sequence[str] | None = None) -> int:
    """Train the LM for ``--steps`` steps at ``--opt-level``; exit code 0."""
    return _common.run("lm", argv, DEFAULT_STEPS, build)


if __name__ == "__main__":
    raise SystemExit(main())
