"""The cast cache as the O1 functions use it inline: only parameters are looked up, a hit is
served from one entry, misses are counted in bulk (entries stored) yet exactly, and the
general path (arguments in containers) shares the same entries."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampatch as amp
from ampatch.session.session import current

BF16 = torch.bfloat16


def o4(*models: nn.Module) -> torch.optim.Optimizer:
    ms = list(models) or [nn.Linear(2, 2)]
    opt = torch.optim.SGD([p for m in ms for p in m.parameters()], lr=0.1)
    amp.initialize(ms, opt, opt_level="O4", verbosity=0)
    return opt


def counts() -> tuple[int, int, int]:
    cache = current().cache
    return cache.hits, cache.misses, len(cache)


def test_tensors_that_are_not_parameters_never_reach_the_cache():
    o4()
    x = torch.randn(3, 4)
    leaf = torch.randn(4, 4, requires_grad=True)  # a leaf that requires grad, not a parameter
    frozen = nn.Parameter(torch.randn(4, 4), requires_grad=False)
    for _ in range(3):
        F.linear(x, leaf)
        F.linear(x, frozen)
        torch.mm(x, leaf.t())
    assert counts() == (0, 0, 0)


def test_misses_are_the_casts_cached_and_stay_exact_through_clears_stale_entries_and_forgets():
    lin = nn.Linear(4, 4)
    o4(lin)
    x = torch.randn(2, 4)
    lin(x)
    lin(x)
    assert counts() == (2, 2, 2)                  # weight and bias: cast once, reused once
    with torch.no_grad():
        lin.weight.mul_(2)                        # an in-place update the cache must see
    lin(x)
    assert counts() == (3, 3, 2)                  # bias hit; the weight's stale entry replaced
    current().clear_casts()
    lin(x)
    assert counts() == (3, 5, 2)
    _ = lin.weight.data                           # about to change unseen: forgotten
    lin(x)
    assert counts() == (4, 6, 2)
    with torch.no_grad():
        lin(x)                                    # casts made with grad serve no-grad calls too
    assert counts() == (6, 6, 2)


def test_no_grad_casts_are_kept_apart_and_go_with_their_parameter():
    o4()
    x = torch.randn(2, 4)
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin(x)
        lin(x)
    assert counts() == (2, 2, 2)
    out = lin(x)                                  # gradients needed: the no-grad casts are not served
    assert counts() == (2, 4, 4) and out.grad_fn is not None
    out.float().sum().backward()
    assert lin.weight.grad is not None
    current().clear_casts()
    del out
    with torch.no_grad():
        lin(x)
    assert counts() == (2, 6, 2)
    del lin
    gc.collect()
    assert counts() == (2, 6, 0)                  # no-grad casts go with their parameters


def test_a_parameter_in_a_container_shares_the_inline_entry():
    """The general path (a parameter in a list) and the inline one serve the same cast."""
    w = nn.Parameter(torch.randn(4, 4))
    o4()

    @amp.half_function
    def stacked_mm(x, weights):
        return torch.ops.aten.mm(x, weights[0])  # the raw op: only the decorator casts

    x = torch.randn(2, 4)
    first = stacked_mm(x, [w])
    second = torch.mm(x, w)
    assert counts() == (1, 1, 1)
    assert torch.equal(first, second) and first.dtype == second.dtype == BF16


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_parameter_frozen_after_its_cast_is_cast_again(grad):
    lin = nn.Linear(4, 4, bias=False)
    o4(lin)
    x = torch.randn(2, 4)
    with torch.set_grad_enabled(grad):
        lin(x)
        lin.weight.requires_grad_(False)
        out = lin(x)
    assert out.grad_fn is None                    # not the cast made while it required grad
