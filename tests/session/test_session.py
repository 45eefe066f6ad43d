"""The session: one object per `initialize` (`session.session.Session`), the live one held by
`current()`, opened on a checked call (`session.prepare.prepare`) and closed by `deinitialize`
or the next `initialize`; what it builds only where it is used."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import ampatch as amp
from ampatch.config.env import Overrides
from ampatch.config.options import Options
from ampatch.session import observers, prepare
from ampatch.session.session import Session, current


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    loss = model(torch.randn(3, 4)).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()


def test_the_live_session_is_the_latest_initialize() -> None:
    assert current() is None
    m1 = _model()
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    m1, o1 = amp.initialize(m1, o1, opt_level="O2", verbosity=0)
    first = current()
    assert isinstance(first, Session) and first.find(o1) is not None
    m2 = _model()
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    amp.initialize(m2, o2, opt_level="O1", verbosity=0)
    assert current() is not first and first.closed
    assert m1[0].weight.dtype == torch.float32 and "step" not in vars(o1)   # the first one was undone
    with pytest.raises(RuntimeError, match="not passed to amp.initialize"):
        current().handle(o1)
    amp.deinitialize()
    assert current() is None and "step" not in vars(o2)


def test_a_session_that_fails_half_way_is_closed_and_changes_nothing() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="keep_fp32"):   # found only once the models are looked at
        amp.initialize(model, opt, opt_level="O2", keep_fp32=["no_such_module"], verbosity=0)
    assert current() is None
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.param_groups[0]["params"][0] is model[0].weight and "step" not in vars(opt)


def test_a_call_refused_by_the_checks_leaves_the_previous_session() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    live = current()
    with pytest.raises(ValueError, match="same model twice"):
        amp.initialize([model, model], opt, opt_level="O1")
    with pytest.raises(TypeError, match="num_losses|verbosity"):
        amp.initialize(model, opt, verbosity="loud")
    assert current() is live and not live.closed and model[0].weight.dtype == torch.bfloat16


def test_a_cast_model_builds_no_o1_machinery() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for _ in range(2):
        _step(model, opt)
    s = current()
    assert "o1" not in vars(s) and "counters" not in vars(s.telemetry)
    assert s.observers == [] and s.kept == []
    report = amp.report().to_dict()
    assert report["casts"] == {} and report["cache"] == {"hits": 0, "misses": 0} and report["steps"] == 2


def test_o1_builds_its_cache_and_counts_casts() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16, verbosity=0)
    _step(model, opt)
    report = amp.report().to_dict()
    assert report["casts"] and report["cache"]["misses"] > 0


def test_observers_are_attached_only_when_the_environment_asks(monkeypatch) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv("AMPATCH_MAX_STEPS", "5")
    amp.initialize(model, opt, opt_level="O0", verbosity=0)
    assert [type(o) for o in current().observers] == [observers.StopAfter]


def test_a_session_opened_without_a_recorder_refuses_to_diagnose() -> None:
    """The session never imports the recorder (it sits beside it): the public API hands it in."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = prepare.prepare(Options(opt_level="O2"), model, opt, Overrides(diagnose="/dev/null"))
    with pytest.raises(RuntimeError, match="without a recorder"):
        Session.open(prepared)
    assert model[0].weight.dtype == torch.float32 and "step" not in vars(opt)   # closed again
