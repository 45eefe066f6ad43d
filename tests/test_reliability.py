"""Reliability (issue 12): exceptions mid-step, hostile values, long runs, checkpoints.

Each test reproduces one defect of the issue (its id in the test's docstring) and fails
without the fix. Models are tiny; float16 runs where a dynamic scale is the point.
"""
from __future__ import annotations

import copy
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp

FP16, BF16 = torch.float16, torch.bfloat16


def init(models, optimizers, level, half=FP16, **kw):
    kw.setdefault("verbosity", 0)
    return amp.initialize(models, optimizers, opt_level=level, half_dtype=half, **kw)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def data(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g) * 0.5, torch.randn(8, 2, generator=g) * 0.5


def grads(opt) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in amp.master_params(opt)]


def masters(opt) -> list[torch.Tensor]:
    return [p.detach().clone() for p in amp.master_params(opt)]


# ============================================================== D1: exceptions in scale_loss
class Boom(Exception):
    pass


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_exception_after_backward_leaves_unscaled_grads(level):
    """D1: block 1 backward; block 2 backward then raise. The grads hold block 1's plus the
    new part unscaled (plain PyTorch: 2x), and the next step applies that, not ~65537x."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    x, y = data()
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    one = grads(opt)
    with pytest.raises(Boom):
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
            sl.backward()
            raise Boom
    two = grads(opt)
    for a, b in zip(one, two):
        torch.testing.assert_close(b, 2 * a, rtol=2e-2, atol=1e-5)
    before = masters(opt)
    opt.step()
    for w0, w1, g in zip(before, masters(opt), two):
        torch.testing.assert_close(w1, w0 - 0.1 * g, rtol=1e-4, atol=1e-5)
    assert amp.report().skipped_steps == []


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_keyboard_interrupt_from_a_backward_hook_leaves_unscaled_grads(level):
    """D1: a KeyboardInterrupt raised by a backward hook (a partial backward: the last layer
    got its new grads, the first did not) leaves no scaled grads behind."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, level)
    x, y = data()
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    one = grads(opt)

    def interrupt(_grad):
        raise KeyboardInterrupt

    hidden = {}
    handle = model[1].register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
    loss = F.mse_loss(model(x), y)
    handle.remove()
    hidden["h"].register_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        with amp.scale_loss(loss, opt) as sl:
            sl.backward()
    two = grads(opt)
    # params: [w1, b1, w2, b2]; the hook stopped the backward before the first layer
    for i in (0, 1):
        torch.testing.assert_close(two[i], one[i], rtol=0, atol=0)
    for i in (2, 3):
        torch.testing.assert_close(two[i], 2 * one[i], rtol=2e-2, atol=1e-5)
    # training goes on normally
    opt.step()
    opt.zero_grad()
    with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
        sl.backward()
    opt.step()
    assert amp.report().skipped_steps == []


def test_exception_with_non_finite_new_part_skips_the_next_step():
    """D1: the new part of an aborted block holds an inf: the next step is skipped."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = init(model, opt, "O2")
    x, y = data()
    opt.zero_grad()
    with pytest.raises(Boom):
        with amp.scale_loss(F.mse_loss(model(x), y), opt) as sl:
            sl.backward()
            model[0].weight.grad[0, 0] = float("inf")
            raise Boom
    before = masters(opt)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, masters(opt)))
    assert amp.report().skipped_steps == [0]
