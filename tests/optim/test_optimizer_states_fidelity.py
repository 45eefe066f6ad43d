"""optimizer_states train like the optimizer's own FP32 state: every elementwise torch.optim
optimizer the issue names, at O0, O2 and O5, on a held-out fine-tune.

A student network starts from a teacher's weights, perturbed, and is fine-tuned on the
teacher's outputs plus noise; what counts is the loss on a held-out set. Each optimizer's run
with "bfloat16" and "int8" state ends within 5% of O0's progress (the held-out loss its FP32
state run at O0 gains) of its own level's FP32-state run. (The fuller table, with a
Transformers model and the tune grid's family at several learning rates: scripts/
optimizer_states_fidelity.py, docs/optimizer_states.md.)
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ampatch as amp

D, H, OUT, BATCH, STEPS = 32, 128, 48, 32, 60  # both weights hold at least 4096 elements: int8 keeps them
TOLERANCE = 0.05  # of O0's progress
OPTIMIZERS = {
    "Adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=3e-3),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=2e-3),
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=0.9),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=3e-4),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.02),
}


@pytest.fixture(autouse=True)
def _end_session():
    yield
    amp.deinitialize()


def teacher() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, OUT))


TEACHER = teacher()


def student() -> nn.Sequential:
    m = teacher()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    with torch.no_grad():
        return x, TEACHER(x) + 0.05 * torch.randn(n, OUT, generator=g)


HELD_OUT = data(10_000, 1024)


def held_out_loss(model: nn.Module) -> float:
    x, y = HELD_OUT
    with torch.no_grad():
        return float(((model.float()(x) - y) ** 2).mean())


def fine_tune(name: str, level: str, states: str) -> float:
    """The held-out loss after fine-tuning with optimizer `name` at `level` and `states`."""
    model = student()
    opt = OPTIMIZERS[name](model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=level, optimizer_states=states, verbosity=0)
    for i in range(STEPS):
        x, y = data(i, BATCH)
        opt.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    amp.deinitialize()
    return held_out_loss(model)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_kept_state_trains_within_five_percent_of_o0s_progress(name):
    start = held_out_loss(student())
    progress = start - fine_tune(name, "O0", "float32")
    assert progress > 0.2 * start  # the fine-tune learns: a deviation against it means something
    deviations = {}
    for level in ("O0", "O2", "O5"):
        reference = fine_tune(name, level, "float32")
        for states in ("bfloat16", "int8"):
            deviations[f"{level} {states}"] = abs(fine_tune(name, level, states) - reference) / progress
    assert max(deviations.values()) <= TOLERANCE, deviations
