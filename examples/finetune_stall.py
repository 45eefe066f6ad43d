"""Fine-tuning at a small learning rate: pure-bfloat16 weights stall, FP32 masters learn.

A "pretrained" network (weights of a trained model's scale: std 0.1, not a fresh
initialisation's) is fine-tuned with AdamW at lr 2e-5 to a target a little off what it
computes. Adam moves every weight by about the learning rate per step, 2e-5: bfloat16 keeps
8 significant bits, so a weight of 0.1 moves only in steps of about 0.0005, and an update
below half of that rounds away. At O3 (the model in bfloat16, no FP32 master weights) about
90% of the weights never change and the loss stays where it started; O2/O5 step FP32 masters
and learn as O0 does:

    python examples/finetune_stall.py --opt-level O0      # the loss falls
    python examples/finetune_stall.py --opt-level O3      # it barely moves
    ampatch tune --levels O3,O5 -- python examples/finetune_stall.py
    ampatch diagnose --opt-level O3 -- python examples/finetune_stall.py

`tune` rejects O3 (it learns a fraction of what O0 learns; its recorded run names the stalled
weights) and chooses a level with masters; `diagnose` names the stalled modules, recommends
master weights and shows the rerun following O0. The data is drawn from torch's global
generator after `amp.initialize`, as many training scripts draw theirs.
"""
from __future__ import annotations

import argparse
import logging

import torch
from torch import nn

import ampatch as amp

log = logging.getLogger("finetune-example")
NOISE = 2.8


class Net(nn.Module):
    def __init__(self, d_in: int = 32, d: int = 256, d_out: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d)
        self.norm1 = nn.LayerNorm(d)
        self.fc2 = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.norm1(self.fc1(x)))
        h = nn.functional.gelu(self.norm2(self.fc2(h)))
        return self.head(h)


def pretrained(seed: int) -> Net:
    """A network with weights at a trained model's scale (std 0.1, biases too)."""
    torch.manual_seed(seed)
    net = Net()
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(1.0 if name.startswith("norm") and name.endswith("weight") else 0.0, 0.1)
    return net


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--opt-level", default="O3")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    model = pretrained(args.seed)
    target = pretrained(args.seed)                  # the task: the same network, its head shifted
    with torch.no_grad():
        target.head.weight.add_(torch.randn_like(target.head.weight) * 0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level, half_dtype=torch.bfloat16)
    for step in range(args.steps):
        x = torch.randn(2048, 32)                   # torch's global generator, after initialize
        with torch.no_grad(), amp.disable_casts():  # the targets: FP32 at every level
            y = target(x)
        y = y + NOISE * torch.randn_like(y)          # what no model can learn: most of the loss
        loss = nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled:
            scaled.backward()
        optimizer.step()
        if step % 10 == 0:
            log.info("step %d loss %.5f", step, loss.item())
    r = amp.report()
    print(f"final loss {loss.item():.5f}  ({r.opt_level}, half dtype {r.half_dtype})")
    return loss.item()


if __name__ == "__main__":
    main()
