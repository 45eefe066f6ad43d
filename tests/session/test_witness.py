"""The weights witness (`ampatch.session.witness`, ``AMPATCH_WITNESS``): a fixed random projection
of the weights the optimizers step, at 0, 1, 2, 4, ... applied updates and the last; the same
projection in every run; the run's own random numbers untouched; FP32 masters where they exist."""
from __future__ import annotations

import torch
from torch import nn

import ampatch as amp
from ampatch.config import env
from ampatch.session import witness


def _train(monkeypatch, tmp_path, level: str, steps: int = 5, skip_at: int | None = None,
           record: bool = True) -> tuple[witness.Witness | None, torch.Tensor]:
    if record:
        monkeypatch.setenv(env.REPORT, str(tmp_path / "report.json"))
        monkeypatch.setenv(env.WITNESS, str(tmp_path / "witness.json"))
    else:
        monkeypatch.delenv(env.REPORT, raising=False)
        monkeypatch.delenv(env.WITNESS, raising=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, loss_scale="dynamic" if skip_at is not None else None,
                                verbosity=0)
    for step in range(steps):
        x = torch.randn(8, 16)
        loss = model(x).float().pow(2).mean()
        if step == skip_at:
            loss = loss * float("inf")      # an overflow: the step is skipped, the weights stay
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    after = torch.rand(3)                   # the run's own random numbers, after training
    amp.deinitialize()
    return witness.latest() if record else None, after


def test_it_records_the_start_powers_of_two_and_the_last_update(monkeypatch, tmp_path):
    w, _ = _train(monkeypatch, tmp_path, "O0", steps=6)
    assert [p.updates for p in w.points] == [0, 1, 2, 4, 6]
    assert w.dims == witness.DIMS == len(w.points[0].sketch) and w.loss_dtype == "float32"
    assert w.points[0].moved == 0 and w.points[-1].moved == 1.0
    assert w.params == 16 * 32 + 32 + 32 * 4 + 4 and w.sampled == w.params   # a small model is taken whole
    assert witness.Witness.from_dict(w.to_dict()) == w


def test_a_skipped_step_is_not_an_update(monkeypatch, tmp_path):
    w, _ = _train(monkeypatch, tmp_path, "O0", steps=5, skip_at=2)
    assert [p.updates for p in w.points] == [0, 1, 2, 4]        # 5 steps, one skipped: 4 updates


def test_the_projection_is_the_same_in_every_run_and_reads_the_fp32_masters(monkeypatch, tmp_path):
    o0, _ = _train(monkeypatch, tmp_path, "O0")
    o5, _ = _train(monkeypatch, tmp_path, "O5")
    assert o5.points[0].sketch == o0.points[0].sketch           # the FP32 masters start as O0's weights
    assert o5.points[-1].sketch != o0.points[-1].sketch


def test_it_leaves_the_runs_random_numbers_alone(monkeypatch, tmp_path):
    _, with_witness = _train(monkeypatch, tmp_path, "O0")
    _, without = _train(monkeypatch, tmp_path, "O0", record=False)
    assert torch.equal(with_witness, without)
