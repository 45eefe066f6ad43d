"""The models the sections train, and one training step per mode (fp32, autocast, an
ampatch level) built the way each recipe says."""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

from .harness import Env

Workload = tuple[nn.Module, tuple[torch.Tensor, torch.Tensor], Callable[..., torch.Tensor]]


# Losses look F.* up at call time, as a training script does: under O1 they are patched.
def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def cross_entropy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def transformer(env: Env) -> Workload:
    """2 x TransformerEncoderLayer(256, 4, 1024), batch 16 x 64 tokens, MSE to a target."""
    model = nn.Sequential(*[nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True) for _ in range(2)])
    x = torch.randn(16, 64, 256)
    y = torch.randn(16, 64, 256)
    return model.to(env.device), (x.to(env.device), y.to(env.device)), mse_loss


def mlp(env: Env) -> Workload:
    """60 x (Linear(64, 64) + LayerNorm + GELU), batch 64: per-call overhead dominates."""
    layers: list[nn.Module] = []
    for _ in range(60):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()]
    x = torch.randn(64, 64)
    y = torch.randn(64, 64)
    return nn.Sequential(*layers).to(env.device), (x.to(env.device), y.to(env.device)), mse_loss


def cnn(env: Env) -> Workload:
    """Conv-BN-ReLU net on 32 x 3 x 32 x 32 images, 10 classes, cross entropy.

    Activations dominate its memory (as in most conv nets), which is what O2 saves on."""
    def block(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()]

    model = nn.Sequential(*block(3, 32), *block(32, 32), *block(32, 64, 2), *block(64, 64),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))
    x = torch.randn(32, 3, 32, 32)
    y = torch.randint(0, 10, (32,))
    return model.to(env.device), (x.to(env.device), y.to(env.device)), cross_entropy


def gpu_transformer(env: Env, c: dict[str, int]) -> Workload:
    """nn.TransformerEncoder(d_model, heads, layers) with torch's defaults otherwise
    (feed-forward 2048, dropout 0.1), batch x seq tokens, MSE to a target."""
    layer = nn.TransformerEncoderLayer(c["d_model"], c["heads"], batch_first=True)
    model = nn.TransformerEncoder(layer, c["layers"], enable_nested_tensor=False)
    x = torch.randn(c["batch"], c["seq"], c["d_model"], device=env.device)
    y = torch.randn(c["batch"], c["seq"], c["d_model"], device=env.device)
    return model.to(env.device), (x, y), mse_loss


def make_mode(mode: str, base: nn.Module, data: tuple, loss_fn: Callable, env: Env) -> tuple[Callable, Any]:
    """(one full training step, returning its loss; the optimizer) for `mode` on a fresh deep
    copy of `base`: fp32, autocast (with a GradScaler when the half type is float16, as torch's
    recipe says), or an ampatch level, which calls amp.initialize here: the caller calls
    amp.deinitialize() after."""
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = data
    if mode == "fp32":
        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            return loss
    elif mode == "autocast":
        scaler = torch.amp.GradScaler(env.device.type) if env.half == torch.float16 else None

        def step() -> torch.Tensor:
            opt.zero_grad()
            with env.autocast():
                loss = loss_fn(model(x), y)
            if scaler is None:  # bfloat16 needs no GradScaler
                loss.backward()
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            return loss
    else:
        model, opt = amp.initialize(model, opt, opt_level=mode, half_dtype=env.half, verbosity=0)

        def step() -> torch.Tensor:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            opt.step()
            return loss
    return step, opt
