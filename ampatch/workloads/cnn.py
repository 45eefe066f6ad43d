"""Workload: a small conv net with batch norm on generated 3x32x32 images, 10 classes.

Each class is a fixed smooth random pattern; an image is its class pattern plus noise, so
the net can learn something in a few dozen steps. SGD with momentum. Batch norm is what
makes this workload interesting for O2/O5 (``keep_batchnorm_fp32``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ampatch import workloads
from ampatch.workloads import _common

CLASSES, BATCH, DATASET = 10, 64, 1024
DEFAULT_STEPS = workloads.DEFAULT_STEPS["cnn"]


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class SmallConvNet(nn.Module):
    """Three conv-BN-ReLU stages with pooling, global average pool, linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(conv_bn(3, 32), nn.MaxPool2d(2), conv_bn(32, 64),
                                      nn.MaxPool2d(2), conv_bn(64, 128),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(128, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def make_batches(steps: int, seed: int) -> list[_common.Batch]:
    """A fixed generated dataset, then ``steps`` random batches drawn from it."""
    gen = torch.Generator().manual_seed(seed)
    patterns = F.interpolate(torch.randn(CLASSES, 3, 8, 8, generator=gen), size=32,
                             mode="bilinear", align_corners=False)
    labels = torch.randint(0, CLASSES, (DATASET,), generator=gen)
    images = patterns[labels] + 2.0 * torch.randn(DATASET, 3, 32, 32, generator=gen)
    picks = torch.randint(0, DATASET, (steps, BATCH), generator=gen)
    return [(images[p], labels[p]) for p in picks]


def build(args: argparse.Namespace):
    """Model, optimizer, batches and loss for ``args``."""
    model = SmallConvNet().to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optimizer, make_batches(args.steps, args.seed + 1), F.cross_entropy


def main(argv: Sequence[str] | None = None) -> int:
    """Train the conv net for ``--steps`` steps at ``--opt-level``; exit code 0."""
    return _common.run("cnn", argv, DEFAULT_STEPS, build)


if __name__ == "__main__":
    raise SystemExit(main())
