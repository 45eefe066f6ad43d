"""Lightning Fabric: ampatch's opt levels through a precision plugin.

`Fabric(plugins=[AmpatchFabricPrecision("O2")])` trains with half weights, FP32 master
weights and a dynamic loss scale (O2/O5), or any other level, in a plain Fabric loop:
`fabric.setup(model, optimizer)` (the model with its optimizers, in one call),
`fabric.backward(loss)`, `fabric.clip_gradients(...)`, `optimizer.step()`. The model is
Lightning's own demo Transformer (its positional encoding is built inside forward) on a
toy next-token task (no downloads).

    pip install 'ampatch[integrations]'
    python examples/lightning_fabric.py --opt-level O2 --steps 30
    ampatch compare --levels O0,O2,O5 -- python examples/lightning_fabric.py --steps 30
"""
from __future__ import annotations

import argparse

import torch
from lightning.fabric import Fabric
from lightning.pytorch.demos import Transformer
from torch.nn import functional as F

import ampatch as amp
from ampatch.lightning import AmpatchFabricPrecision

VOCAB, SEQ = 64, 16


def batches(steps: int, batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Counting sequences (each token is the previous one plus one): easy to learn."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (steps, batch, 1), generator=g)
    ids = (start + torch.arange(SEQ + 1)) % VOCAB
    return [(s[:, :-1], s[:, 1:]) for s in ids]


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AmpatchFabricPrecision(args.opt_level)])
    model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=1, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loss = torch.tensor(float("nan"))
    for inputs, target in batches(args.steps):
        loss = F.nll_loss(model(inputs, target), target.reshape(-1))
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0, error_if_nonfinite=False)
        optimizer.step()
        optimizer.zero_grad()
    level = amp.report().opt_level  # the level that ran (`ampatch run/compare` may force one)
    fabric.strategy.precision.teardown()  # the model FP32 again
    print(f"final loss {loss.item():.4f}  ({level}, {args.steps} steps)")
    return loss.item()


if __name__ == "__main__":
    main()
