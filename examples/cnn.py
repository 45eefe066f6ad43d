"""Train a small CNN with batch norm at any opt level.

    python examples/cnn.py --opt-level O2 --steps 100
    python examples/cnn.py --opt-level O1 --half-dtype float16

The only ampatch-specific lines are `amp.initialize` and `amp.scale_loss`; switching
`--opt-level` between O0 (FP32), O1/O4 (patched casts), O2/O5 (half model, FP32 batch
norm and FP32 master weights) and O3 (pure half) changes nothing else. The data are
generated (one smooth random pattern per class, plus noise), so nothing is downloaded and
the loss falls within a few dozen steps. Runs on CPU in seconds; on CUDA if available.
Note: float16 convolutions and matmuls are slow on CPU; `auto` picks bfloat16 there.
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

CLASSES, SIZE = 10, 16


class SmallCNN(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def make_data(n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` images of SIZE x SIZE: a per-class smooth pattern plus noise."""
    gen = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.randn(CLASSES, 3, 4, 4, generator=gen), size=SIZE, mode="bilinear",
                             align_corners=False)
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    images = patterns[labels] + 0.7 * torch.randn(n, 3, SIZE, SIZE, generator=gen)
    return images.to(device), labels.to(device)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--opt-level", default="O1", help="O0 (FP32) ... O5 (default: %(default)s)")
    p.add_argument("--steps", type=int, default=60, help="training steps (default: %(default)s)")
    p.add_argument("--half-dtype", default="auto", choices=("auto", "float16", "bfloat16"),
                   help="the half type: auto = float16 on CUDA, bfloat16 on CPU (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--print-every", type=int, default=10, help="print loss and step time every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> float:
    """Train; print loss and mean step time every `--print-every` steps; return the last loss."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = SmallCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      half_dtype=None if args.half_dtype == "auto" else args.half_dtype)

    images, labels = make_data(max(1024, args.batch_size), args.seed + 1, device)
    gen = torch.Generator().manual_seed(args.seed + 2)
    report = amp.report()
    print(f"opt_level {report.opt_level}  half dtype {report.half_dtype or '-'}  device {device}  "
          f"steps {args.steps}")
    loss_value, window_start = float("nan"), time.perf_counter()
    for step in range(1, args.steps + 1):
        pick = torch.randint(0, len(labels), (args.batch_size,), generator=gen).to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images[pick]), labels[pick])
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % args.print_every == 0 or step == args.steps:
            loss_value = loss.item()  # syncs the device, so the time below is real
            n = args.print_every if step % args.print_every == 0 else step % args.print_every
            ms = (time.perf_counter() - window_start) * 1000.0 / n
            print(f"step {step:5d}  loss {loss_value:.4f}  {ms:8.2f} ms/step  loss scale {amp.loss_scale():g}")
            window_start = time.perf_counter()
    amp.deinitialize()
    return loss_value


if __name__ == "__main__":
    main()
