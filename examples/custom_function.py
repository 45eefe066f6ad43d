"""Your own ops under O1: register them, or decorate them, so they run in the right dtype.

- `amp.register_float_function(module, "name")` for a function you cannot edit (a compiled
  extension, a library): under O1/O4 its floating args are cast to FP32. Call it before
  `initialize`; `register_half_function` / `register_promote_function` work the same way.
- `@amp.half_function` (or `float_function`, `promote_function`) on a function you own.
Under O2/O3 nothing is patched: the whole model runs in half, so these have no effect.

    python examples/custom_function.py --opt-level O1
"""
from __future__ import annotations

import argparse
import types

import torch
from torch import nn

import ampatch as amp

SEEN: dict[str, torch.dtype] = {}  # the dtype each op received, for the printout

# A stand-in for an extension you cannot edit (`import my_ext`): written for FP32 only
# (a sum of squares overflows float16 for values above ~256).
my_ext = types.ModuleType("my_ext")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    SEEN["my_ext.rms_norm"] = x.dtype
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


my_ext.rms_norm = _rms_norm


@amp.half_function  # a GEMM of your own: worth running in half
def linear_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    SEEN["linear_gelu"] = x.dtype
    return nn.functional.gelu(torch.addmm(bias, x, weight.t()))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 32) / 32 ** 0.5)
        self.bias = nn.Parameter(torch.zeros(64))
        self.norm = nn.Parameter(torch.ones(64))
        self.head = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear_gelu(x, self.weight, self.bias)  # half under O1
        h = my_ext.rms_norm(h, self.norm)           # FP32 under O1 (looked up at call time)
        return self.head(h)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opt-level", default="O1", choices=["O0", "O1", "O2", "O3", "O4", "O5"])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    SEEN.clear()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(512, 32, device=device)
    y = (x[:, :4].sum(1) > 0).long()
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)

    amp.register_float_function(my_ext, "rms_norm")  # before initialize
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level)
    for step in range(args.steps):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()

    for name, dtype in SEEN.items():
        print(f"{name:16s} received {dtype}")
    print(f"final loss {loss.item():.4f}  ({args.opt_level})")
    return loss.item()


if __name__ == "__main__":
    main()
