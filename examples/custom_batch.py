"""A custom batch object under O2: give it a `.to(dtype)` and ampatch casts it for you.

Under O2/O3/O5 the model's `forward` casts floating tensors in its inputs to half; a batch
class with a `.to(dtype)` method is cast through that method, so it decides what to cast
(here: the float features, not the integer token ids). Outputs come back in FP32.

    python examples/custom_batch.py --opt-level O2
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

import ampatch as amp


@dataclass
class Batch:
    tokens: torch.Tensor    # int64 ids: must never become half
    features: torch.Tensor  # float: cast to the half dtype under O2
    labels: torch.Tensor

    def to(self, dtype_or_device) -> "Batch":
        def move(t: torch.Tensor) -> torch.Tensor:
            if isinstance(dtype_or_device, torch.dtype) and not t.is_floating_point():
                return t  # a dtype applies to floating tensors only
            return t.to(dtype_or_device)
        return Batch(**{f.name: move(getattr(self, f.name)) for f in dataclasses.fields(self)})


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 16)
        self.mlp = nn.Sequential(nn.Linear(16 + 8, 64), nn.ReLU(), nn.Linear(64, 2))
        self.seen: tuple[torch.dtype, torch.dtype] | None = None

    def forward(self, batch: Batch) -> torch.Tensor:
        self.seen = (batch.tokens.dtype, batch.features.dtype)
        return self.mlp(torch.cat([self.embed(batch.tokens).mean(1), batch.features], dim=1))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O2", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = torch.randint(0, 100, (256, 6))
    features = torch.randn(256, 8)
    data = Batch(tokens, features, ((tokens < 50).sum(1) > 3).long()).to(device)
    model = Net().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)

    for step in range(args.steps):
        optimizer.zero_grad()
        out = model(data)  # no .half() anywhere: forward casts the batch through Batch.to
        loss = nn.functional.cross_entropy(out, data.labels)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    print(f"forward saw tokens {model.seen[0]}, features {model.seen[1]}; output {out.dtype}")
    print(f"final loss {loss.item():.4f}  ({args.opt_level})")
    return loss.item()


if __name__ == "__main__":
    main()
