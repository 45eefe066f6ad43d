"""Workload: a small conv net with batch norm on generated images (3x32x32 at size large), 10 classes.

Each class is a fixed smooth random pattern; an image is its class pattern plus noise, so
the net can learn something in a few dozen steps. SGD with momentum. Batch norm is what
makes this workload interesting for O2/O5 (``keep_batchnorm_fp32``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ampatch import workloads
from ampatch.workloads import _common

CLASSES, DATASET = 10, 1024
DEFAULT_STEPS = workloads.DEFAULT_STEPS["cnn"]
LR = 0.05


@dataclass(frozen=True)
class Dims:
    """The three stages' channels, the image side and the batch, for one size."""

    widths: tuple[int, int, int]
    image: int
    batch: int

    def describe(self) -> str:
        return f"channels {'/'.join(map(str, self.widths))}, {self.image}x{self.image} images, batch {self.batch}"


SIZES = {"tiny": Dims((8, 16, 32), 16, 32), "small": Dims((16, 32, 64), 16, 32),
         "medium": Dims((16, 32, 64), 32, 32), "large": Dims((32, 64, 128), 32, 64),
         "huge": Dims((64, 128, 256), 32, 128)}


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class SmallConvNet(nn.Module):
    """Three conv-BN-ReLU stages with pooling, global average pool, linear classifier."""

    def __init__(self, widths: tuple[int, int, int] = SIZES[workloads.DEFAULT_SIZE].widths) -> None:
        super().__init__()
        a, b, c = widths
        self.features = nn.Sequential(conv_bn(3, a), nn.MaxPool2d(2), conv_bn(a, b),
                                      nn.MaxPool2d(2), conv_bn(b, c),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(c, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def make_batches(steps: int, seed: int, dims: Dims = SIZES[workloads.DEFAULT_SIZE]) -> list[_common.Batch]:
    """A fixed generated dataset, then ``steps`` random batches drawn from it."""
    gen = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.randn(CLASSES, 3, 8, 8, generator=gen), size=dims.image,
                             mode="bilinear", align_corners=False)
    labels = torch.randint(0, CLASSES, (DATASET,), generator=gen)
    images = patterns[labels] + 2.0 * torch.randn(DATASET, 3, dims.image, dims.image, generator=gen)
    picks = torch.randint(0, DATASET, (steps, dims.batch), generator=gen)
    return [(images[p], labels[p]) for p in picks]


def build(args: argparse.Namespace):
    """Model, optimizer, batches and loss for ``args``."""
    dims = SIZES[args.size]
    model = SmallConvNet(dims.widths).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return model, optimizer, make_batches(args.steps, args.seed + 1, dims), F.cross_entropy


def main(argv: Sequence[str] | None = None) -> int:
    """Train the conv net for ``--steps`` steps at ``--opt-level``; exit code 0."""
    return _common.run("cnn", argv, DEFAULT_STEPS, build)


if __name__ == "__main__":
    raise SystemExit(main())
