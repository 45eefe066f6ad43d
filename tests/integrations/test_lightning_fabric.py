"""ampatch.lightning.AmpatchFabricPrecision: Lightning Fabric's loop (`fabric.setup`,
`fabric.backward`, `fabric.clip_gradients`, `optimizer.step()`) gives the losses of the
hand-written ampatch loop at every level, on Lightning's own demos.Transformer; checkpoints
through `fabric.save`/`fabric.load` restore masters, optimizer state and loss scaler; a
second `fabric.setup` (a GAN's two networks) keeps the FP32 masters exact; a policy alone
decides the level; what cannot work is refused with the fix."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampatch as amp

lightning = pytest.importorskip("lightning")
from lightning.fabric import Fabric  # noqa: E402
from lightning.pytorch.demos import Transformer  # noqa: E402

from ampatch.lightning import AmpatchFabricPrecision  # noqa: E402

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
LEVELS = ["O0", "O1", "O2", "O3", "O4", "O5"]
UNCAST = ("O0", "O1", "O4")
VOCAB, SEQ, STEPS = 32, 8, 3


def fabric(level: str | None = "O2", **kwargs: object) -> Fabric:
    plugin = AmpatchFabricPrecision(level, **{"half_dtype": BF16, "verbosity": 0, **kwargs})
    return Fabric(accelerator="cpu", devices=1, plugins=[plugin])


def batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (n, 4, SEQ + 1), generator=g)
    return [(d[:, :-1], d[:, 1:]) for d in data]


def transformer() -> Transformer:
    torch.manual_seed(0)
    return Transformer(vocab_size=VOCAB, ninp=16, nhead=2, nhid=32, nlayers=1, dropout=0.0)


@pytest.mark.parametrize("level", LEVELS)
def test_fabric_loop_matches_the_hand_loop(level: str) -> None:
    model = transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    f = fabric(level)
    model, optimizer = f.setup(model, optimizer)
    got = []
    for inputs, target in batches():
        loss = F.nll_loss(model(inputs, target), target.reshape(-1))
        f.backward(loss)
        f.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        got.append(loss.item())
    assert next(model.parameters()).dtype == (F32 if level in UNCAST else BF16)
    f.strategy.precision.teardown()
    assert all(p.dtype == F32 for p in model.parameters())
    assert f.strategy.precision.last_report.steps == len(got)  # the session's report, kept past teardown

    hand = transformer()
    opt = torch.optim.AdamW(hand.parameters(), lr=1e-2)
    hand, opt = amp.initialize(hand, opt, opt_level=level, half_dtype=BF16, verbosity=0)
    want = []
    for inputs, target in batches():
        loss = F.nll_loss(hand(inputs, target), target.reshape(-1))
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 0.5)
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    amp.deinitialize()
    assert all(math.isfinite(v) for v in got)
    if level in UNCAST:
        assert got == want
    else:
        assert got[0] == want[0] and got == pytest.approx(want, rel=2e-2)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def run(f: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, steps: range,
        inf_at: int | None = None) -> list[float]:
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(8)]
    losses = []
    for i in steps:
        x, y = data[i]
        loss = F.cross_entropy(model(x), y)
        f.backward(loss * float("inf") if i == inf_at else loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_checkpoint_restores_masters_optimizer_state_and_loss_scaler(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.manual_seed(0)
    f = fabric("O2", half_dtype=F16)  # a dynamic loss scale
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = f.setup(model, optimizer)
    plugin = f.strategy.precision
    run(f, model, optimizer, range(3), inf_at=0)  # the first step overflows: the scale moved
    f.save(path, {"model": model, "optimizer": optimizer, "ampatch": plugin})
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    scaler = amp.state_dict()
    whole = run(f, model, optimizer, range(3, 6))
    plugin.teardown()

    torch.manual_seed(1)  # other initial weights: everything comes from the checkpoint
    g = fabric("O2", half_dtype=F16)
    model2 = MLP()
    optimizer2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    model2, optimizer2 = g.setup(model2, optimizer2)
    g.load(path, {"model": model2, "optimizer": optimizer2, "ampatch": g.strategy.precision})
    assert amp.state_dict() == scaler and scaler["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    for a, b in zip(amp.master_params(optimizer2), masters):
        assert a.dtype == F32 and torch.equal(a, b)
    assert run(g, model2, optimizer2, range(3, 6)) == whole
    g.strategy.precision.teardown()


def test_a_second_setup_keeps_the_masters_exact() -> None:
    """A GAN sets its two networks up one after the other: the session is made again with
    both, and the first network's masters are still its FP32 initial weights."""
    torch.manual_seed(0)
    gen, disc = MLP(), nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    initial = [p.detach().clone() for p in gen.parameters()]
    f = fabric("O2")
    gen, opt_g = f.setup(gen, torch.optim.Adam(gen.parameters(), lr=1e-3))
    disc, opt_d = f.setup(disc, torch.optim.Adam(disc.parameters(), lr=1e-3))
    assert all(torch.equal(m, p) for m, p in zip(amp.master_params(opt_g), initial))
    assert next(gen.parameters()).dtype == next(disc.parameters()).dtype == BF16
    x = torch.randn(4, 8)
    fake = gen(x)
    d_loss = F.binary_cross_entropy_with_logits(disc(fake.detach()), torch.zeros(4, 1))
    f.backward(d_loss)
    assert all(m.grad is None for m in amp.master_params(opt_g))  # detached: the generator got nothing
    assert all(m.grad is not None for m in amp.master_params(opt_d))
    before = [m.detach().clone() for m in amp.master_params(opt_d)]
    opt_d.step()
    assert all(not torch.equal(a, m) for a, m in zip(before, amp.master_params(opt_d)))
    f.strategy.precision.teardown()


@pytest.mark.parametrize("policy,level", [({"opt_level": "O4"}, "O4"), ({"opt_level": "O0"}, "O0"), (None, "O2")])
def test_a_policy_alone_decides_the_level(policy: dict | None, level: str) -> None:
    f = Fabric(accelerator="cpu", devices=1, plugins=[AmpatchFabricPrecision(policy=policy, verbosity=0)])
    model = MLP()
    f.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert amp.report().opt_level == level
    f.strategy.precision.teardown()


def test_what_cannot_work_is_refused_with_the_fix() -> None:
    f = fabric("O2")
    model = f.setup_module(MLP())  # no optimizers: inference only
    with pytest.raises(RuntimeError, match=r"fabric.setup\(model, optimizer\)"):
        f.backward(model(torch.randn(2, 8)).sum())
    f.strategy.precision.teardown()
    g = fabric("O2")
    model = MLP()
    model, optimizer = g.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="closure"):
        optimizer.step(closure=lambda: 0.0)
    with pytest.raises(RuntimeError, match="inside fabric.setup"):
        AmpatchFabricPrecision("O2").convert_module(MLP())
    g.strategy.precision.teardown()


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_fabric.py"


def test_the_example_runs(capsys: pytest.CaptureFixture) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("ampatch_example_lightning_fabric", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loss = module.main(["--steps", "3", "--opt-level", "O5"])
    out = capsys.readouterr().out
    assert "final loss" in out and "(O5, 3 steps)" in out and math.isfinite(loss)
